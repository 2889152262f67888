//! Fakes for tests: a check for code that consumes check results (registry, reporting, the
//! link), and an LMCache MP worker speaking the real protocol for the `mp_worker` check.

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

/// How [`serve_mp_worker`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpWorkerMode {
    /// As LMCache's MP worker: echo the request id and op, then the result
    /// (no-op 24 → `"OK"`, ping 22 → `true`, get_chunk_size 21 → 256).
    Answer,
    /// Reply with another request id (a protocol mismatch).
    WrongId,
    /// Complete the ZMTP handshake, then never answer (a stuck request loop).
    Silent,
}

/// Binds a ZMQ ROUTER at `endpoint` (e.g. `tcp://127.0.0.1:0`) and returns the bound endpoint
/// and the serving future, which answers LMCache MP-worker requests per `mode` until dropped.
/// The exact bytes of the protocol (TESTING.md): request `[07][18]` → reply `[07][18][a2 4f 4b]`;
/// `[08][16][c0]` → `[08][16][c3]`; `[0a][15]` → `[0a][15][cd 01 00]`. Errors: the bind error.
pub async fn serve_mp_worker(
    endpoint: &str,
    mode: MpWorkerMode,
) -> Result<(String, impl std::future::Future<Output = ()>), zeromq::ZmqError> {
    use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};
    let mut router = zeromq::RouterSocket::new();
    let bound = router.bind(endpoint).await?.to_string();
    let serve = async move {
        while let Ok(req) = router.recv().await {
            let frames = req.into_vec();
            // [identity, request id, op, args…]
            let (Some(identity), Some(id), Some(op)) =
                (frames.first(), frames.get(1), frames.get(2))
            else {
                continue;
            };
            if mode == MpWorkerMode::Silent {
                continue;
            }
            let result: Vec<u8> = match op.as_ref() {
                [0x18] => vec![0xa2, b'O', b'K'],
                [0x16] => vec![0xc3],
                [0x15] => vec![0xcd, 0x01, 0x00],
                _ => vec![0xc0],
            };
            let id: Vec<u8> = if mode == MpWorkerMode::WrongId {
                vec![0x7f]
            } else {
                id.to_vec()
            };
            let mut reply = ZmqMessage::from(identity.to_vec());
            reply.push_back(id.into());
            reply.push_back(op.to_vec().into());
            reply.push_back(result.into());
            if router.send(reply).await.is_err() {
                break;
            }
        }
    };
    Ok((bound, serve))
}
