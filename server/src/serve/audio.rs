//! (being written) Pipeline audio -> a client's format, streaming.
