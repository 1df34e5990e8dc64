//! gRPC services and KV-transfer wire types shared by the router and the workers.
