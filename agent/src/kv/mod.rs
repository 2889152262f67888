//! KV-event subscribers (placeholder).
