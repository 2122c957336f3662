//! Deploy profiles (YAML in `deploy/`).
