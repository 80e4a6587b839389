package client

import (
	"io"
	"log/slog"
	"testing"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/wire"
)

// nodeApply applies a batch's events to sched.Request as the node would.
func nodeApply(t *testing.T, lay *sched.Layout, reqs map[string]*sched.Request, b *wire.Batch) {
	t.Helper()
	dec, bad, err := ingest.DecodeBatch("e", b.Body(nil, "x", 1), ingest.Limits{})
	if err != nil || len(bad) > 0 {
		t.Fatalf("decode: %v %v", err, bad)
	}
	for i := range dec.Events {
		ev := &dec.Events[i]
		r := reqs[ev.Request]
		if ev.Type == messages.EvAdded {
			if r == nil {
				reqs[ev.Request] = sched.NewRequest(lay, ev)
			}
			continue
		}
		if err := r.Step(ev); err != nil {
			t.Logf("node rejects %v: %v", ev.Type, err)
		}
	}
}

// The node forgets computed at preempted (docs/PROTOCOL.md "preemption
// forgets computed"); a mirror that kept it would, at a resync after
// resumed and new blocks and before the engine's next tokens, tell the node
// the new (unwritten) blocks hold KV, and the node would store them under
// the prompt's keys.
func TestAResyncAfterResumedDoesNotRestoreTheForgottenComputed(t *testing.T) {
	sp := messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "e1-kv"}},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 64, BlockBytes: 64}}}}}
	lay, err := sched.NewLayout(&sp)
	if err != nil {
		t.Fatal(err)
	}
	c := &Client{reqs: map[string]*mreq{}, groups: 1, st: Stats{Resyncs: map[string]int{}},
		cfg: Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxBatchBytes: 1 << 20},
		out: newDispatcher(nil, nil, nil), epoch: "e1"}
	defer c.out.close()

	orig := map[string]*sched.Request{}
	c.Added("r", 8)
	c.Hashes("r", 0, []byte{0xaa}, []byte{0xbb})
	c.Blocks("r", 0, 0, []uint32{1, 2})
	c.Tokens("r", 8, 8)
	c.Preempted("r")
	nodeApply(t, lay, orig, &c.batch)
	c.batch.Reset()
	// the node releases the preemption; the engine resumes with new blocks
	c.reqs["r"].owed = 0 // as freeLocked would, after the release
	c.reqs["r"].clearBlocks()
	c.Resumed("r")
	c.Blocks("r", 0, 0, []uint32{7, 9}) // allocated, KV not recomputed yet
	nodeApply(t, lay, orig, &c.batch)
	c.batch.Reset()

	// a resync now (any reason) re-announces the mirror
	fresh := map[string]*sched.Request{}
	c.reannounceLocked(func() {})
	nodeApply(t, lay, fresh, &c.batch)

	t.Logf("node after the original stream: T=%d blocks=%v", orig["r"].Offloadable(), orig["r"].HasBlocks())
	t.Logf("node after the resync:          T=%d blocks=%v", fresh["r"].Offloadable(), fresh["r"].HasBlocks())
	if fresh["r"].Offloadable() != orig["r"].Offloadable() {
		t.Fatalf("the resync tells the node blocks [7 9] hold %d tokens of KV; the original stream said %d",
			fresh["r"].Offloadable(), orig["r"].Offloadable())
	}
}
