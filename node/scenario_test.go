package node_test

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// The core's vLLM scenarios replayed end to end: whatever order tokens,
// hashes and blocks arrive in (one batch each), the same three chunks are
// stored, each exactly once, with the engine's bytes (PROTOCOL.md, "ready
// prefix").
func TestEveryLagOrderStoresTheSameChunks(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	orders := [][3]string{
		{"tokens", "hashes", "blocks"}, {"tokens", "blocks", "hashes"}, {"hashes", "tokens", "blocks"},
		{"hashes", "blocks", "tokens"}, {"blocks", "tokens", "hashes"}, {"blocks", "hashes", "tokens"},
	}
	for i, order := range orders {
		t.Run(fmt.Sprint(order), func(t *testing.T) {
			te := e.newEngine(fmt.Sprintf("lag%d", i), defaultOpts())
			te.register()
			fam := fmt.Sprintf("o%d", i)
			hs := []string{hash(fam, 0), hash(fam, 1), hash(fam, 2)}
			for b := 1; b <= 3; b++ {
				te.fill(0, messages.BlockID(b), byte(i))
			}
			evs := map[string]map[string]any{
				"tokens": tokensEv("r", 12, 12),
				"hashes": hashesEv("r", 0, hs...),
				"blocks": blocksEv("r", 0, 0, 1, 2, 3),
			}
			te.send(added("r", 12))
			for _, kind := range order {
				te.send(evs[kind])
			}
			st := recv(t, te.stored, "stored")
			require.Equal(t, []int{0, 1, 2}, chunkIndexes(st), "all chunks in one job once the last term arrives")
			none(te, te.stored, "second store")
			r := te.loadInto("check", hs, 12, []int{10, 11, 12})
			require.True(t, r.OK, r.Error)
			for b := 0; b < 3; b++ {
				require.True(t, bytes.Equal(te.block(0, messages.BlockID(1+b)), te.block(0, messages.BlockID(10+b))))
			}
		})
	}
}

// Blocks lag: 12 tokens, 3 hashes, 1 block stores chunk 0; chunks 1 and 2
// follow when their blocks arrive (vLLM's "blocks lagging" scenario).
func TestBlocksLagStoresLaterChunksWhenBlocksArrive(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	hs := []string{hash("b", 0), hash("b", 1), hash("b", 2)}
	te.send(added("r", 12), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 7), tokensEv("r", 12, 12))
	require.Equal(t, []int{0}, chunkIndexes(recv(t, te.stored, "chunk 0")))
	te.send(blocksEv("r", 0, 1, 8, 9))
	require.Equal(t, []int{1, 2}, chunkIndexes(recv(t, te.stored, "chunks 1, 2")))
	st := te.sync()
	require.Len(t, st.Requests, 1)
	require.EqualValues(t, 3, st.Requests[0].Groups[0].Cursor)
}

// A released request's blocks can be overwritten at once: every copy of the
// request finished before released was published (PROTOCOL.md, "The engine
// must not reuse a request's GPU blocks ... until released arrives").
func TestReleasedOnlyAfterCopiesFinish(t *testing.T) {
	t.Parallel()
	dev := &heldDevice{started: make(chan struct{}, 64), gate: make(chan struct{})}
	e := startNode(t, func(c *node.Config) { c.WrapDevice = dev.wrap })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	var hs []string
	var ids []int
	want := map[int][]byte{}
	for i := 0; i < 16; i++ {
		hs = append(hs, hash("rel", i))
		ids = append(ids, 30+i)
		te.fill(0, messages.BlockID(30+i), 9)
		want[i] = append([]byte(nil), te.block(0, messages.BlockID(30+i))...)
	}
	te.send(added("r", 64), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, ids...), tokensEv("r", 64, 64),
		finishedEv("r", false, 64, 64))
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy")
	testkit.NoRecv(t, te.released, 200*time.Millisecond, "r's release while its copy is held")
	close(dev.gate)
	require.Equal(t, "finished", recv(t, te.released, "released").Reason)
	for _, id := range ids { // the engine reuses the blocks right away
		te.fill(0, messages.BlockID(id), 200)
	}
	r := te.loadInto("check", hs, 64, []int{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	require.True(t, r.OK, r.Error) // all ids 0: nothing copied, still a hit
	load := make([]int, 16)
	for i := range load {
		load[i] = 1 + i
	}
	r = te.loadInto("check", hs, 64, load)
	require.True(t, r.OK, r.Error)
	for i := 0; i < 16; i++ {
		require.True(t, bytes.Equal(want[i], te.block(0, messages.BlockID(1+i))), "chunk %d changed after release", i)
	}
}

// PROTOCOL.md "finished": a request aborted while queued (no blocks) makes
// no job and is released at once; finished for an unknown request too.
func TestQueuedAbortIsReleasedAtOnce(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("q", 8), hashesEv("q", 0, hash("q", 0), hash("q", 1)), finishedEv("q", true, 0, 8))
	require.Equal(t, messages.Released{Request: "q", Reason: "aborted"}, recv(t, te.released, "released"))
	te.send(finishedEv("ghost", false, 4, 4))
	require.Equal(t, messages.Released{Request: "ghost", Reason: "finished"}, recv(t, te.released, "released"))
	none(te, te.stored, "a store")
	none(te, te.released, "a second release")
}

// PROTOCOL.md "preempted": no new job, release once copies are done, block
// ids cleared, cursors kept; after resumed, fresh blocks store the rest.
func TestPreemptionReleasesAndResumes(t *testing.T) {
	t.Parallel()
	dev := &heldDevice{started: make(chan struct{}, 64), gate: make(chan struct{})}
	e := startNode(t, func(c *node.Config) { c.WrapDevice = dev.wrap })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	hs := []string{hash("p", 0), hash("p", 1), hash("p", 2)}
	te.send(added("r", 12), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 3, 4, 5), tokensEv("r", 4, 12))
	testkit.Recv(t, dev.started, 5*time.Second, "chunk 0's copy")
	te.send(map[string]any{"type": "preempted", "request": "r"})
	testkit.NoRecv(t, te.released, 200*time.Millisecond, "the preemption's release while chunk 0's copy is held")
	close(dev.gate)
	require.Equal(t, []int{0}, chunkIndexes(recv(t, te.stored, "chunk 0")))
	require.Equal(t, "preempted", recv(t, te.released, "released").Reason)
	te.send(map[string]any{"type": "preempted", "request": "r"}, blocksEv("r", 0, 3, 6)) // ignored; rejected
	none(te, te.released, "second release")
	st := te.sync()
	require.Equal(t, 0, st.Requests[0].Groups[0].Blocks, "block ids cleared")
	require.EqualValues(t, 1, st.Requests[0].Groups[0].Cursor, "cursor kept")
	te.send(map[string]any{"type": "resumed", "request": "r"}, blocksEv("r", 0, 0, 13, 14, 15), tokensEv("r", 12, 12))
	require.Equal(t, []int{1, 2}, chunkIndexes(recv(t, te.stored, "chunks 1, 2")))
	te.send(finishedEv("r", false, 12, 12))
	require.Equal(t, "finished", recv(t, te.released, "released").Reason)
}

// PROTOCOL.md "epoch": a new epoch drops every request; those with GPU
// blocks get one engine_reset release; duplicate seqs are ignored.
func TestNewEpochResetsEngine(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("a", 8), blocksEv("a", 0, 0, 1), added("b", 8))
	te.seq = 1
	te.send(added("dup", 8)) // seq 2 is new: applied
	te.seq = 1
	te.send(added("dup2", 8)) // seq 2 again: a duplicate, ignored
	st := te.sync()
	require.Len(t, st.Requests, 3)
	te.epoch, te.seq = "ep2", 0
	te.send(added("c", 8))
	require.Equal(t, messages.Released{Request: "a", Reason: "engine_reset"}, recv(t, te.released, "reset"))
	none(te, te.released, "release of a request without blocks")
	st = te.sync()
	require.Len(t, st.Requests, 1)
	require.Equal(t, "c", st.Requests[0].Request)
}

// Two engines with the same layout in one namespace share the pool: a prefix
// stored by A is a hit for B and loads into B's blocks byte for byte (issue
// 7; PROTOCOL.md "Isolation": only within a namespace).
func TestPrefixStoredByOneEngineLoadsIntoAnother(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	a := e.newEngine("ea", defaultOpts())
	b := e.newEngine("eb", defaultOpts())
	a.spec.Namespace, b.spec.Namespace = "shared", "shared"
	a.register()
	b.register()
	hs := []string{hash("x", 0), hash("x", 1), hash("x", 2), hash("x", 3)}
	for i := 0; i < 4; i++ {
		a.fill(0, messages.BlockID(40+i), 77)
	}
	a.send(added("r", 16), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 40, 41, 42, 43), tokensEv("r", 16, 16))
	recv(t, a.stored, "stored by A")
	require.Equal(t, 16, b.lookup(hs))
	require.Equal(t, 8, b.lookup([]string{hs[0], hs[1], hash("other", 2), hs[3]}), "stop at the first miss")
	r := b.loadInto("rb", hs, 16, []int{2, 3, 4, 5})
	require.True(t, r.OK, r.Error)
	for i := 0; i < 4; i++ {
		require.True(t, bytes.Equal(a.block(0, messages.BlockID(40+i)), b.block(0, messages.BlockID(2+i))))
	}
	// B stores the same prefix: deduplicated, no job.
	b.send(added("rb", 16), hashesEv("rb", 0, hs...), blocksEv("rb", 0, 0, 2, 3, 4, 5), tokensEv("rb", 16, 16))
	none(b, b.stored, "a store of a deduplicated prefix")
}
