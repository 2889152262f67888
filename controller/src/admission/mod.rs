//! AdmissionReview server: CacheBackend defaulting and validation, Pod wiring (placeholder).
