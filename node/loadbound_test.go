package node_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// An engine's loads pinned and queued or copying are bounded
// (node.MaxCopyingLoads): past it a load is answered "node overloaded" at
// once, having pinned nothing. Loads go ahead of stores in the copy queue
// and hold pins, not pool room, so one engine loading faster than the
// copies run would otherwise grow the queue without bound. Every copy is
// held; the engine's loads are handled in the order sent, so the one past
// the bound is answered while the others wait; let go, they all load.
func TestAnEnginesLoadsInFlightAreBounded(t *testing.T) {
	t.Parallel()
	dev := &heldDevice{started: make(chan struct{}, 4*node.MaxCopyingLoads), gate: make(chan struct{}, 4*node.MaxCopyingLoads)}
	var logs testkit.SyncBuffer
	e := startNode(t, func(c *node.Config) {
		c.WrapDevice, c.Log = dev.wrap, slog.New(slog.NewTextHandler(&logs, nil))
	})
	storedOneChunk(t, e, dev)

	replies := floodLoads(t, e.nc, "e1", []string{hash("r", 0)}, 4, []int{5})
	requireOverloadedFirst(t, replies)
	require.Equal(t, 1.0, e.counter("kvactors_events_rejected_total", "limit"))
	// Logged with the reason it is counted under, as every refusal's line is.
	require.Regexp(t, `level=ERROR msg="load refused" .*reason=limit`, logs.String())

	for range 2 * node.MaxCopyingLoads {
		dev.gate <- struct{}{}
	}
	for range node.MaxCopyingLoads {
		var r messages.LoadReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 10*time.Second, "a held load's answer").Data, &r))
		require.True(t, r.OK, r.Error)
	}
}

// floodLoads sends node.MaxCopyingLoads+1 loads (the same chunks into the
// same blocks) of engine id over nc, the i'th answered on
// _INBOX.<id>.ld.<i>, and returns the answers as they come.
func floodLoads(t *testing.T, nc *nats.Conn, id string, hashes []string, tokens int, blocks []int) <-chan *nats.Msg {
	t.Helper()
	replies := make(chan *nats.Msg, node.MaxCopyingLoads+1)
	sub, err := nc.ChanSubscribe("_INBOX."+id+".ld.*", replies)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	for i := range node.MaxCopyingLoads + 1 {
		data, err := json.Marshal(map[string]any{"request": fmt.Sprint("l", i), "hashes": hashes,
			"num_tokens": tokens, "blocks": [][]int{blocks}})
		require.NoError(t, err)
		require.NoError(t, nc.PublishRequest("kvactors."+id+".load", fmt.Sprintf("_INBOX.%s.ld.%d", id, i), data))
	}
	return replies
}

// requireOverloadedFirst takes the first answer of a floodLoads: the load
// past the bound's (the last one sent), refused "node overloaded" at once.
func requireOverloadedFirst(t *testing.T, replies <-chan *nats.Msg) {
	t.Helper()
	m := testkit.Recv(t, replies, 10*time.Second, "the answer to the load past the bound")
	require.True(t, strings.HasSuffix(m.Subject, fmt.Sprintf(".%d", node.MaxCopyingLoads)), "answered first: %s %s", m.Subject, m.Data)
	var rep messages.LoadReply
	require.NoError(t, json.Unmarshal(m.Data, &rep))
	require.False(t, rep.OK)
	require.Contains(t, rep.Error, messages.Overloaded)
}

// An engine's loads in flight are bounded in chunks too, not only in
// count: a load names one stored chunk as often as its max_model_len
// allows (the same hash, the same block), and its job keeps ~150 bytes of
// heap per chunk, so 256 loads of a 1 MB body each (~500,000 chunks with
// 64 groups) would hold ~19 GB for one engine, which the intake's byte
// budget never sees. Past the bound (here 8) a load is answered "node
// overloaded" at once, counted as limit; one that fits goes on, and a
// load over the whole bound is refused too_large, alone or not. A load's
// chunks are let go as it ends, answered or failed.
func TestAnEnginesLoadsInFlightAreBoundedInChunks(t *testing.T) {
	t.Parallel()
	dev := &heldDevice{started: make(chan struct{}, 16), gate: make(chan struct{}, 16), fail: new(atomic.Bool)}
	e := startNode(t, node.WithLoadChunksBound(8), func(c *node.Config) { c.WrapDevice = dev.wrap })
	storedOneChunk(t, e, dev)

	replies := make(chan *nats.Msg, 8)
	sub, err := e.nc.ChanSubscribe("_INBOX.e1.lc.*", replies)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	loadOf := func(family string, i, chunks int) { // chunks copies of family's first chunk, each 4 tokens, into block 5
		hashes, blocks := make([]string, chunks), make([]int, chunks)
		for c := range chunks {
			hashes[c], blocks[c] = hash(family, 0), 5
		}
		data, err := json.Marshal(map[string]any{"request": fmt.Sprint("l", i), "hashes": hashes,
			"num_tokens": 4 * chunks, "blocks": [][]int{blocks}})
		require.NoError(t, err)
		require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", fmt.Sprintf("_INBOX.e1.lc.%d", i), data))
	}
	load := func(i, chunks int) { loadOf("r", i, chunks) }
	answer := func(what string) (int, messages.LoadReply) {
		t.Helper()
		m := testkit.Recv(t, replies, 10*time.Second, what)
		var r messages.LoadReply
		require.NoError(t, json.Unmarshal(m.Data, &r))
		var i int
		_, err := fmt.Sscanf(m.Subject[strings.LastIndexByte(m.Subject, '.')+1:], "%d", &i)
		require.NoError(t, err)
		return i, r
	}

	load(0, 5) // 5 of 8: held copying
	testkit.Recv(t, dev.started, 5*time.Second, "load 0's copy")
	load(1, 5) // 10 of 8: refused at once
	i, r := answer("the answer to the load past the bound")
	require.Equal(t, 1, i, "answered first")
	require.False(t, r.OK)
	require.Contains(t, r.Error, messages.Overloaded)
	require.Equal(t, 1.0, e.counter("kvactors_events_rejected_total", "limit"))
	load(2, 3) // 8 of 8: goes on
	testkit.Recv(t, dev.started, 5*time.Second, "load 2's copy")
	dev.gate <- struct{}{}
	dev.gate <- struct{}{}
	for range 2 {
		i, r := answer("a held load's answer")
		require.True(t, r.OK, "load %d: %s", i, r.Error)
	}

	loadOf("x", 3, 8) // a miss: its chunks are let go with its answer
	i, r = answer("the missing chunk's answer")
	require.Equal(t, 3, i)
	require.False(t, r.OK)
	require.NotContains(t, r.Error, messages.Overloaded)

	load(4, 9) // over the whole bound, alone in flight: too large
	i, r = answer("the large load's answer")
	require.Equal(t, 4, i)
	require.False(t, r.OK)
	require.Contains(t, r.Error, "more than 8 chunks")
	require.Equal(t, 1.0, e.counter("kvactors_events_rejected_total", "too_large"))

	load(5, 8) // the whole bound, alone in flight: goes on
	testkit.Recv(t, dev.started, 5*time.Second, "load 5's copy")
	dev.gate <- struct{}{}
	i, r = answer("the lone load's answer")
	require.Equal(t, 5, i)
	require.True(t, r.OK, r.Error)

	dev.fail.Store(true) // the whole bound again, its copy failing: its chunks are let go with its error
	load(6, 8)
	testkit.Recv(t, dev.started, 5*time.Second, "load 6's copy")
	dev.gate <- struct{}{}
	i, r = answer("the failed copy's answer")
	require.Equal(t, 6, i)
	require.False(t, r.OK)
	require.NotContains(t, r.Error, messages.Overloaded)
	dev.fail.Store(false)
	load(7, 8) // taken only if load 6 gave its 8 back
	testkit.Recv(t, dev.started, 5*time.Second, "load 7's copy")
	dev.gate <- struct{}{}
	i, r = answer("the load after a failed one")
	require.Equal(t, 7, i)
	require.True(t, r.OK, r.Error)
}

// storedOneChunk registers e1 and stores request r's one chunk through dev
// (held: the test lets its copy go).
func storedOneChunk(t *testing.T, e *env, dev *heldDevice) {
	t.Helper()
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.oneChunkReady("r")
	testkit.Recv(t, dev.started, 5*time.Second, "r's store copy")
	dev.gate <- struct{}{}
	recv(t, te.stored, "r's chunk stored")
}

// A load is counted in its engine's loads in flight before its chunks are
// built: one past the room the others leave is refused having built none
// (it built up to the whole bound, then found no room: twice the bound's
// heap while the others held theirs), and a build never finds the
// engine's loads holding more than the bound, its own counted. Loads sent
// back to back, every copy held, take the room in turn.
func TestALoadPastTheRoomLeftBuildsNoChunks(t *testing.T) {
	t.Parallel()
	const most = 8
	var mu sync.Mutex
	var built []int
	dev := &heldDevice{started: make(chan struct{}, 16), gate: make(chan struct{}, 16)}
	e := startNode(t, node.WithLoadChunksBound(most), func(c *node.Config) { c.WrapDevice = dev.wrap },
		node.WithLoadBuilt(func(chunks int, held int64) {
			mu.Lock()
			defer mu.Unlock()
			built = append(built, chunks)
			if held > most {
				t.Errorf("a load of %d chunks built with %d in flight, over %d", chunks, held, most)
			}
		}))
	storedOneChunk(t, e, dev)
	replies := make(chan *nats.Msg, 8)
	sub, err := e.nc.ChanSubscribe("_INBOX.e1.room.*", replies)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	load := func(i, chunks int) { // chunks copies of r's first chunk into block 5
		hashes, blocks := make([]string, chunks), make([]int, chunks)
		for c := range chunks {
			hashes[c], blocks[c] = hash("r", 0), 5
		}
		data, err := json.Marshal(map[string]any{"request": fmt.Sprint("l", i), "hashes": hashes,
			"num_tokens": 4 * chunks, "blocks": [][]int{blocks}})
		require.NoError(t, err)
		require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", fmt.Sprintf("_INBOX.e1.room.%d", i), data))
	}
	answer := func(what string) (string, messages.LoadReply) {
		t.Helper()
		m := testkit.Recv(t, replies, 10*time.Second, what)
		var r messages.LoadReply
		require.NoError(t, json.Unmarshal(m.Data, &r))
		return m.Subject[strings.LastIndexByte(m.Subject, '.')+1:], r
	}

	load(0, 7) // 7 of 8: held copying
	testkit.Recv(t, dev.started, 5*time.Second, "load 0's copy")
	load(1, 5) // 12 of 8: refused, none built
	i, r := answer("the answer to the load past the room")
	require.Equal(t, "1", i)
	require.Contains(t, r.Error, messages.Overloaded)
	mu.Lock()
	require.Equal(t, []int{7}, built, "only load 0 built its chunks")
	mu.Unlock()

	for j := range 4 { // back to back: 1 fits (8 of 8), the rest wait for room that is not there
		load(2+j, 1)
	}
	for range 3 {
		_, r := answer("a load past the room")
		require.Contains(t, r.Error, messages.Overloaded)
	}
	for range 2 {
		dev.gate <- struct{}{}
	}
	for range 2 {
		i, r := answer("a held load's answer")
		require.True(t, r.OK, "load %s: %s", i, r.Error)
	}
	mu.Lock()
	require.Equal(t, []int{7, 1}, built, "the loads refused built none")
	mu.Unlock()
}
