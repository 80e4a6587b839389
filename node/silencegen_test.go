package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// silenceLease is long: no expiry and no session tick within a test.
const silenceLease = time.Minute

// silenceRig is a node whose liveness clock the test moves (no message
// comes while it does), with one copy worker whose copies wait on dev.
type silenceRig struct {
	e     *env
	dev   *heldDevice
	start time.Time
	clock atomic.Int64
}

func newSilenceRig(t *testing.T, edit func(*node.Config)) *silenceRig {
	t.Helper()
	r := &silenceRig{start: time.Unix(1_800_000_000, 0),
		dev: &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}}
	r.clock.Store(r.start.UnixNano())
	r.e = startNode(t, func(c *node.Config) {
		c.Lease = silenceLease
		c.Transfer.Workers = 1
		c.WrapDevice = r.dev.wrap
		if edit != nil {
			edit(c)
		}
	}, node.WithClock(func() time.Time { return time.Unix(0, r.clock.Load()) }))
	t.Cleanup(func() { close(r.dev.gate) })
	return r
}

// fallSilent moves the clock lease/2 past the start: nothing was heard.
func (r *silenceRig) fallSilent() { r.clock.Store(r.start.Add(silenceLease / 2).UnixNano()) }

// storeA registers e1 and stores request a's one chunk (block 1).
func (r *silenceRig) storeA(t *testing.T) *testEngine {
	t.Helper()
	te := r.e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4))
	testkit.Recv(t, r.dev.started, 5*time.Second, "store copy of a")
	r.dev.gate <- struct{}{}
	recv(t, te.stored, "stored a")
	return te
}

// publishLoad sends a load of a's chunk into block 9 and returns where its
// answer comes.
func (r *silenceRig) publishLoad(t *testing.T) <-chan *nats.Msg {
	t.Helper()
	reply := make(chan *nats.Msg, 1)
	inbox := testkit.EngineInbox("e1")
	_, err := r.e.nc.ChanSubscribe(inbox, reply)
	require.NoError(t, err)
	body, err := json.Marshal(map[string]any{"request": "l", "hashes": []string{hash("a", 0)}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	require.NoError(t, err)
	require.NoError(t, r.e.nc.PublishRequest("kvactors.e1.load", inbox, body))
	return reply
}

// stallSilenced holds the engine actor in its "engine silent" log line
// (entered closes then) until release closes.
type stallSilenced struct {
	slog.Handler
	entered chan struct{}
	release chan struct{}
	once    *sync.Once
}

func (h stallSilenced) Handle(ctx context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, "engine silent for lease/2") {
		h.once.Do(func() { close(h.entered) })
		<-h.release
	}
	return h.Handler.Handle(ctx, r)
}

func (h stallSilenced) WithAttrs(a []slog.Attr) slog.Handler {
	return stallSilenced{h.Handler.WithAttrs(a), h.entered, h.release, h.once}
}

func (h stallSilenced) WithGroup(g string) slog.Handler {
	return stallSilenced{h.Handler.WithGroup(g), h.entered, h.release, h.once}
}

// The message that ends an engine's silence refreshes when the node heard
// it at once, while the reset of the old requests it brings reaches their
// queued copies a few hops later (engine actor, request actors, transfer
// actor). Held in that window (the engine actor stalls in its "engine
// silent" log line), a queued copy of the old epoch still never starts: it
// carries the silence generation its epoch began in (transfer.Hearing.Gen).
func TestACopyOfAnEpochBeforeASilenceNeverStarts(t *testing.T) {
	t.Parallel()
	h := stallSilenced{Handler: slog.NewTextHandler(io.Discard, nil), entered: make(chan struct{}),
		release: make(chan struct{}), once: &sync.Once{}}
	r := newSilenceRig(t, func(c *node.Config) { c.Log = slog.New(h) })
	t.Cleanup(func() { close(h.release) })
	te := r.e.newEngine("e1", defaultOpts())
	te.register()
	heldAndQueued(t, te, r.dev)

	r.fallSilent()
	data, err := json.Marshal(map[string]any{"epoch": te.epoch, "seq": te.seq})
	require.NoError(t, err)
	require.NoError(t, r.e.nc.Publish("kvactors.e1.heartbeat", data))
	testkit.Closed(t, h.entered, 5*time.Second, "engine.Silenced handled")
	r.dev.gate <- struct{}{} // a ends; the worker takes b while the reset is held
	testkit.NoRecv(t, r.dev.started, 300*time.Millisecond, "copy b of the silenced epoch starting before its reset")
}

// A load taken before an engine's silence, still queued behind another copy
// when the silence ends, never copies after it (the engine may have given
// up on it and reused its destination blocks): its silence generation is
// older.
func TestALoadQueuedBeforeASilenceNeverCopiesAfterIt(t *testing.T) {
	t.Parallel()
	r := newSilenceRig(t, nil)
	te := r.storeA(t)
	// b's store holds the one worker; a load of a's chunk queues behind it.
	te.send(added("b", 4), hashesEv("b", 0, hash("b", 0)), blocksEv("b", 0, 0, 2), tokensEv("b", 4, 4))
	testkit.Recv(t, r.dev.started, 5*time.Second, "store copy of b")
	r.publishLoad(t)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if q := metricValue(t, r.e.reg, "kvactors_transfer_jobs_queued", nil); q != 1 {
			return fmt.Errorf("%v copies queued", q)
		}
		return nil
	})

	r.fallSilent()
	te.request("heartbeat", map[string]any{"epoch": te.epoch, "seq": te.seq}) // Silenced: requests reset
	require.Equal(t, 1.0, metricValue(t, r.e.reg, "kvactors_engine_silences_total", nil))
	r.dev.gate <- struct{}{} // b ends; the worker takes the load
	testkit.NoRecv(t, r.dev.started, 300*time.Millisecond, "the load taken before the silence copying after it")
}

// A load that is itself the message ending an engine's silence may be one
// sent before the engine declared the node lost, delivered late: it is
// refused (answered with the error), and so is every load until the engine
// begins a new epoch.
func TestALoadEndingASilenceIsRefused(t *testing.T) {
	t.Parallel()
	r := newSilenceRig(t, nil)
	r.storeA(t)
	r.fallSilent()
	m := testkit.Recv(t, r.publishLoad(t), 5*time.Second, "the load's answer")
	require.Contains(t, string(m.Data), "no load until it begins a new epoch")
	testkit.NoRecv(t, r.dev.started, 100*time.Millisecond, "a load delivered after lease/2 of silence copying")
}

// A silence that ends before the engine has begun any epoch (it had sent
// heartbeats only) refuses loads until its first epoch begins, not for
// good: the refusal was lifted only by an epoch that ended another, and
// with none live no resync order named one to begin.
func TestLoadsResumeWithTheFirstEpochAfterASilence(t *testing.T) {
	t.Parallel()
	r := newSilenceRig(t, nil)
	te := r.e.newEngine("e1", defaultOpts())
	te.register()
	r.fallSilent()
	te.request("heartbeat", map[string]any{"epoch": te.epoch, "seq": 0}) // ends the silence; no epoch live
	require.Equal(t, 1.0, metricValue(t, r.e.reg, "kvactors_engine_silences_total", nil))
	refused := testkit.Recv(t, r.publishLoad(t), 5*time.Second, "a load before any epoch")
	require.Contains(t, string(refused.Data), "no load until it begins a new epoch")

	te.send(added("x", 4))                                                    // the engine's first epoch
	te.request("heartbeat", map[string]any{"epoch": te.epoch, "seq": te.seq}) // answered after the batch
	m := testkit.Recv(t, r.publishLoad(t), 5*time.Second, "a load in the first epoch")
	require.NotContains(t, string(m.Data), "no load until it begins a new epoch")
}
