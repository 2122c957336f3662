//! Audio formats and transforms.
