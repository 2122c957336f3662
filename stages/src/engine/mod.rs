//! Stage workers, connectors, requests and the pipeline that joins them.
