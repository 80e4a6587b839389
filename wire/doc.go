// Package wire holds kvactors' hand-written JSON for protocol v1 bodies on
// the hot paths, both sides of the contract:
//
//   - Batch builds a P.E.events body the way an engine does, appending
//     directly into one buffer (the simulated engine and the benchmark
//     drive the node with it, so their own cost stays out of the numbers);
//   - AppendReleased and the pieces of P.E.stored (AppendStoredOpen …) and
//     P.E.kv_events (AppendKVBatchOpen …) encode what kvactors publishes
//     per release, per store job and per pool change, where encoding/json's
//     reflection was a tenth of the node's CPU. The pieces let the caller
//     hex-encode each key straight from the pool key into the body.
//
// Every encoder produces exactly what encoding/json produces for the same
// messages values (kvactors_test.go checks it), and Batch's output decodes with
// ingest.DecodeBatch to the events it was given.
package wire
