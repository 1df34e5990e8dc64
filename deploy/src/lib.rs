//! The launcher: `tandem up`.
