//! A fake check for tests of code that consumes check results (registry, reporting, the link).

use ic_shared::check::CheckResult;
use ic_shared::plan::NodePlan;

use super::Check;

/// Returns fixed results on every run, whatever the plan.
#[derive(Debug, Clone)]
pub struct StaticCheck {
    name: &'static str,
    results: Vec<CheckResult>,
}

impl StaticCheck {
    /// A check called `name` that always returns `results` (possibly empty).
    pub fn new(name: &'static str, results: Vec<CheckResult>) -> Self {
        StaticCheck { name, results }
    }
}

impl Check for StaticCheck {
    fn name(&self) -> &'static str {
        self.name
    }

    fn run(&self, _plan: &NodePlan) -> Vec<CheckResult> {
        self.results.clone()
    }
}
