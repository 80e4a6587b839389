// Package sim is a simulated inference engine that speaks kvactors' wire
// protocol (docs/PROTOCOL.md) over a real NATS connection, through the Go
// engine SDK (package client: epochs, seq, heartbeats, resyncs, releases
// per epoch). The demo, the benchmarks and the integration tests drive
// kvactors with it; Config.DropBatches drops batches in the SDK's transport
// to show that every loss is recovered.
//
// It behaves like vLLM with async scheduling, in the parts that matter to
// an offload service: a scheduler step every Config.StepInterval; chunked
// prefill, then one token per step; GPU blocks allocated ahead of the tokens
// that fill them; block hashes published one step after the tokens they
// cover; shared prompt prefixes (so content-addressed keys deduplicate
// across requests and engines); requests aborted while queued or during
// prefill; preemption under block pressure and on purpose. It owns its GPU
// memory as shm segments and writes a content-addressed byte pattern into
// every block before announcing the tokens that cover it, and it never
// reuses a block before kvactors has published `released` for it.
//
// At the end, Run checks what kvactors did against what the engine knows:
// every chunk reported `stored` is loaded back through P.E.load into scratch
// blocks and compared byte for byte with the pattern; every chunk that was
// ready when its request finished was stored or is present (deduplicated);
// and every finished or preempted request was released exactly once per
// event, each release answering the oldest event owed one with a reason
// that event may get (releaseAnswers). The Report holds the counts and the
// verdict.
//
// Simplifications, chosen so the checks stay exact:
//   - A sliding-window group passes block id 0 only when a preempted request
//     resumes with a local prefix-cache hit, and only for whole chunks that
//     end before the window (vLLM works per block; a chunk half null would
//     make the stored bytes of a key depend on who stored it).
//   - Released GPU blocks are overwritten at once (no chunk's bytes) and
//     reused last-freed first, those a preemption gave up last of all (the
//     request that resumes gets other blocks): a copy made after `released`
//     reads bytes no chunk has, or another request's, and fails
//     verification.
package sim
