//! Human and JSON renderings of a set of check results (`ic-agent check`, `/v1/report`).

use ic_shared::check::{CheckResult, CheckStatus};
use serde_json::{json, Map, Value};

const HEADERS: [&str; 5] = ["CHECK", "SUBJECT", "STATUS", "REASON", "MESSAGE"];

/// Renders results as an aligned text table with the columns
/// `CHECK SUBJECT STATUS REASON MESSAGE` (the message is never truncated), then one overall
/// line: `node <node>: <Worst> (<n> results: <a> ok, <b> warning, <c> critical, <d> unknown)`.
/// An empty `results` renders the header and an overall `Ok` line.
pub fn render_table(node: &str, results: &[CheckResult]) -> String {
    let rows: Vec<[String; 5]> = results
        .iter()
        .map(|r| {
            [
                r.name.clone(),
                r.subject.clone(),
                r.status.to_string(),
                r.reason.clone(),
                // one result, one line: a message never breaks the table
                r.message.replace(['\n', '\r'], " "),
            ]
        })
        .collect();
    let mut widths = HEADERS.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: [&str; 5]| {
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(cell);
            } else {
                l.push_str(cell);
                let pad = widths[i].saturating_sub(cell.chars().count()) + 2;
                l.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(HEADERS);
    for row in &rows {
        line([&row[0], &row[1], &row[2], &row[3], &row[4]]);
    }
    let count = |s: CheckStatus| results.iter().filter(|r| r.status == s).count();
    out.push_str(&format!(
        "node {node}: {} ({} results: {} ok, {} warning, {} critical, {} unknown)\n",
        CheckStatus::worst(results.iter().map(|r| r.status)),
        results.len(),
        count(CheckStatus::Ok),
        count(CheckStatus::Warning),
        count(CheckStatus::Critical),
        count(CheckStatus::Unknown),
    ));
    out
}

/// The JSON report:
/// `{"node": node, "status": "<Worst>", "checks": [{"name", "subject", "status", "reason",
/// "message", "observed": {key: string}}…]}`, with statuses spelled `Ok`, `Warning`,
/// `Critical`, `Unknown` as [`CheckStatus`] serializes them.
pub fn report_json(node: &str, results: &[CheckResult]) -> Value {
    let checks: Vec<Value> = results
        .iter()
        .map(|r| {
            let observed: Map<String, Value> = r
                .observed
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            json!({
                "name": r.name,
                "subject": r.subject,
                "status": r.status.to_string(),
                "reason": r.reason,
                "message": r.message,
                "observed": observed,
            })
        })
        .collect();
    json!({
        "node": node,
        "status": CheckStatus::worst(results.iter().map(|r| r.status)).to_string(),
        "checks": checks,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn sample() -> Vec<CheckResult> {
        vec![
            CheckResult::new(
                "shm",
                "host",
                CheckStatus::Critical,
                "ShmUndersized",
                "too\nsmall",
            )
            .with("sizeBytes", 64u64),
            CheckResult::new(
                "gpu",
                "host",
                CheckStatus::Unknown,
                "NvmlUnavailable",
                "no lib",
            ),
            CheckResult::new("ports", "tcp/8080", CheckStatus::Ok, "PortOk", "free"),
        ]
    }

    #[test]
    fn table_is_aligned_with_overall_line() {
        let t = render_table("node-a", &sample());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert_eq!(
            lines[0],
            "CHECK  SUBJECT   STATUS    REASON           MESSAGE"
        );
        assert_eq!(
            lines[1],
            "shm    host      Critical  ShmUndersized    too small"
        );
        assert_eq!(lines[3], "ports  tcp/8080  Ok        PortOk           free");
        assert_eq!(
            lines[4],
            "node node-a: Critical (3 results: 1 ok, 0 warning, 1 critical, 1 unknown)"
        );
        let empty = render_table("n", &[]);
        assert!(empty.ends_with("node n: Ok (0 results: 0 ok, 0 warning, 0 critical, 0 unknown)\n"));
    }

    #[test]
    fn json_report_shape() {
        let v = report_json("node-a", &sample());
        assert_eq!(v["node"], "node-a");
        assert_eq!(v["status"], "Critical");
        assert_eq!(v["checks"].as_array().map(Vec::len), Some(3));
        assert_eq!(v["checks"][0]["observed"]["sizeBytes"], "64");
        assert_eq!(v["checks"][1]["status"], "Unknown");
        assert_eq!(v["checks"][2]["observed"], json!({}));
        // the entries deserialize back into CheckResult
        let back: CheckResult = serde_json::from_value(v["checks"][0].clone()).unwrap();
        assert_eq!(back, sample()[0]);
    }
}
