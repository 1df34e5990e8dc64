//! The HTTP front door.
