//! The engine pod's self-description, read in one place (issue 42 Deliver 1): which container
//! runs the engine, its command line ([`command::EngineCommand`]), and what its flags mean.
//!
//! This module sits below the Pod webhook ([`crate::admission`]), the runtime adapters
//! ([`crate::adapters`]) and the node plans ([`crate::reconcile::nodes::plans`]); it imports none
//! of them, and none of them parses an engine flag itself.

pub mod command;
