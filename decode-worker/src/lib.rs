//! The decode worker.
