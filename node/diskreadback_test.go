package node_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// storeHeldDevice holds the first store copy (device to host) after armed
// is set, until gate closes; held receives once it holds one.
type storeHeldDevice struct {
	backend.Attachment
	armed atomic.Bool
	held  chan struct{}
	gate  chan struct{}
}

func (d *storeHeldDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	if dir == backend.DeviceToHost && d.armed.CompareAndSwap(true, false) {
		d.held <- struct{}{}
		<-d.gate
	}
	return d.Attachment.Copy(dir, a, r)
}

// loadAsync publishes a load and returns where its reply comes.
func (te *testEngine) loadAsync(req string, hashes []string, tokens int, blocks ...[]int) <-chan *nats.Msg {
	te.e.t.Helper()
	inbox := testkit.EngineInbox(te.id)
	replies := testkit.Subscribe(te.e.t, te.e.nc, inbox)
	body, err := json.Marshal(map[string]any{"request": req, "hashes": hashes, "num_tokens": tokens, "blocks": blocks})
	require.NoError(te.e.t, err)
	require.NoError(te.e.t, te.e.nc.PublishRequest("kvactors."+te.id+".load", inbox, body))
	require.NoError(te.e.t, te.e.nc.Flush())
	return replies
}

func loadReplyOf(t *testing.T, ch <-chan *nats.Msg, what string) messages.LoadReply {
	t.Helper()
	var r messages.LoadReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, ch, 5*time.Second, what).Data, &r))
	return r
}

// readingBack is a node with a two-chunk pool over a disk tier and one
// copy worker, whose engine's chunk a (stored from block 1, want) is on
// disk only, and a load of it into block 10 (first) given room to read it
// back, that room pending while the only copy worker holds a store of d
// until release.
type readingBack struct {
	e       *env
	te      *testEngine
	a       []string
	want    []byte
	first   <-chan *nats.Msg
	release func()
}

func startReadingBack(t *testing.T, mutate ...func(*node.Config)) *readingBack {
	dev := &storeHeldDevice{held: make(chan struct{}, 1), gate: make(chan struct{})}
	e := startNode(t, append([]func(*node.Config){withPoolSlots(2), withDisk(t.TempDir()), func(c *node.Config) {
		c.Transfer.Workers = 1 // one copy at a time: the held store holds the read-back in the queue
		c.WrapDevice = func(a backend.Attachment) backend.Attachment { dev.Attachment = a; return dev }
	}}, mutate...)...)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.fill(0, 1, 9)
	rb := &readingBack{e: e, te: te, a: []string{hash("a", 0)}, want: bytes.Clone(te.block(0, 1))}
	te.storeOne("a", 1)
	te.storeOne("b", 2)
	te.storeOne("c", 3) // evicts a from the pool of two: it is written to disk
	require.Equal(t, rb.a, recvKVHashes(t, te, messages.KVBlockStored, messages.MediumDisk, "", 1))

	dev.armed.Store(true)
	rb.release = sync.OnceFunc(func() { close(dev.gate) })
	t.Cleanup(rb.release) // before the node's Close
	te.send(added("d", 4), hashesEv("d", 0, hash("d", 0)), blocksEv("d", 0, 0, 4), tokensEv("d", 4, 4))
	testkit.Recv(t, dev.held, 5*time.Second, "d's store copy held, the only copy worker with it")

	te.fill(0, 10, 0)
	te.fill(0, 11, 0)
	rb.first = te.loadAsync("l1", rb.a, 4, []int{10})
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if p := te.sync().Pool.Pending; p != 2 {
			return fmt.Errorf("%d chunks pending: want d's and a's room to read it back into", p)
		}
		return nil
	})
	return rb
}

// PROTOCOL.md "load" and "lookup": a chunk on disk that one load is reading
// back (its room in host memory pending, here for its wait in the copy
// queue behind a held store) is a hit for lookups meanwhile, and a second
// load of it waits for that read and then copies it, byte-identical,
// instead of failing "key not ready": a hot prefix on disk loaded by two
// requests at once.
func TestASecondLoadOfAChunkBeingReadBackFromDiskWaitsForIt(t *testing.T) {
	t.Parallel()
	rb := startReadingBack(t)
	te := rb.te
	require.Equal(t, 4, te.lookup(rb.a), "a is loadable while it is read back")
	second := te.loadAsync("l2", rb.a, 4, []int{11})
	testkit.NoRecv(t, second, 100*time.Millisecond, "the second load's reply while the first reads a back")

	rb.release()
	r1 := loadReplyOf(t, rb.first, "the first load's reply")
	require.True(t, r1.OK, r1.Error)
	r2 := loadReplyOf(t, second, "the second load's reply")
	require.True(t, r2.OK, "the second load of a chunk being read back: %s", r2.Error)
	require.Equal(t, rb.want, te.block(0, 10), "the first load: disk → host → device, byte-identical")
	require.Equal(t, rb.want, te.block(0, 11), "the second load: byte-identical")
	st := te.sync().Pool
	require.Zero(t, st.Pinned)
	require.Zero(t, st.Pending)
}

// A load waiting for a chunk another load reads back does not hold up the
// node's Close: it fails at once, the node closing, and copies nothing.
func TestALoadWaitingForAReadBackFailsWhenTheNodeCloses(t *testing.T) {
	t.Parallel()
	rb := startReadingBack(t)
	te := rb.te
	before := bytes.Clone(te.block(0, 11))
	second := te.loadAsync("l2", rb.a, 4, []int{11})
	testkit.NoRecv(t, second, 50*time.Millisecond, "the second load's reply while the first reads a back")
	closed := make(chan error, 1)
	go func() { closed <- rb.e.node.Close(context.Background()) }()
	r2 := loadReplyOf(t, second, "the waiting load's reply as the node closes")
	require.False(t, r2.OK)
	require.Contains(t, r2.Error, "node closing")
	rb.release() // the engine's retire waits for its copies in flight
	require.NoError(t, testkit.Recv(t, closed, 10*time.Second, "Close"))
	require.Equal(t, before, te.block(0, 11), "nothing copied into the failed load's block")
}

// A load waiting for a chunk another copy fills waits Config.LoadWait at
// most, then fails as a miss naming the key, copying nothing: it is
// answered within the engine's request timeout (the Go SDK's 5 s), which a
// wait of a lease (10 s) outlasted, leaving the load in doubt.
func TestALoadWaitsForAPendingKeyAtMostTheLoadWait(t *testing.T) {
	t.Parallel()
	const wait = 300 * time.Millisecond
	rb := startReadingBack(t, func(c *node.Config) { c.LoadWait = wait })
	te := rb.te
	before := bytes.Clone(te.block(0, 11))
	asked := time.Now()
	second := te.loadAsync("l2", rb.a, 4, []int{11})
	r2 := loadReplyOf(t, second, "the waiting load's reply past the load wait, the read back still held")
	require.False(t, r2.OK)
	require.Contains(t, r2.Error, "pending in another copy")
	require.GreaterOrEqual(t, time.Since(asked), wait, "it waited for the read back first")
	require.Equal(t, before, te.block(0, 11), "nothing copied into the failed load's block")
	rb.release()
	require.True(t, loadReplyOf(t, rb.first, "the first load's reply").OK)
	require.Zero(t, te.sync().Pool.Pinned)
}

// An engine's loads waiting for a pending key are bounded (a goroutine
// each, for up to Config.LoadWait): past 64, a load of the key being read back fails
// not-ready at once, as every such load did before loads waited; the 64
// waiting ones still succeed once the read ends.
func TestAnEnginesWaitingLoadsAreBounded(t *testing.T) {
	t.Parallel()
	rb := startReadingBack(t)
	te := rb.te
	const bound = 64
	waiting := make([]<-chan *nats.Msg, bound)
	for i := range waiting {
		waiting[i] = te.loadAsync(fmt.Sprintf("w%d", i), rb.a, 4, []int{11})
	}
	over := loadReplyOf(t, te.loadAsync("over", rb.a, 4, []int{11}), "the load past the bound")
	require.False(t, over.OK)
	require.Contains(t, over.Error, "not ready", "failed as a miss, not waited for")
	require.Equal(t, 1.0, loadWaits(t, rb.e, "too_many"), "the refused wait is counted")
	for i, ch := range waiting {
		testkit.NoRecv(t, ch, 0, fmt.Sprintf("waiting load %d's reply before the read ends", i))
	}
	rb.release()
	require.True(t, loadReplyOf(t, rb.first, "the first load's reply").OK)
	for i, ch := range waiting {
		r := loadReplyOf(t, ch, fmt.Sprintf("waiting load %d's reply", i))
		require.True(t, r.OK, "waiting load %d: %s", i, r.Error)
	}
	require.Equal(t, float64(bound), loadWaits(t, rb.e, "loaded"))
	require.Equal(t, rb.want, te.block(0, 11))
}
