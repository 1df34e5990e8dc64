//! The model runtime shared by both workers.
