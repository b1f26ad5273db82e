//! The isolation acceptance suite (being built).
