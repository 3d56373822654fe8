//! broker
