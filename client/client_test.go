package client_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

const testLease = 400 * time.Millisecond

func spec() messages.EngineSpec {
	return messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "e1-kv"}},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 64, BlockBytes: 64}}}}}
}

// releases collects OnReleased calls.
type releases struct {
	mu  sync.Mutex
	got []client.Release
	ch  chan client.Release
}

func newReleases() *releases { return &releases{ch: make(chan client.Release, 1024)} }

func (r *releases) on(rel client.Release) {
	r.mu.Lock()
	r.got = append(r.got, rel)
	r.mu.Unlock()
	r.ch <- rel
}

func dial(t *testing.T, url, engine string) *nats.Conn {
	t.Helper()
	nc, err := client.Dial(url, engine)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

func connect(t *testing.T, nc *nats.Conn, cfg client.Config) *client.Client {
	t.Helper()
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.Connect(ctx, nc, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// oneRequest announces r: added, blocks, hashes, tokens (one batch), then
// finished in a second batch.
// requireNoneSent fails if the engine's connection enc has published on
// subject, which sub (testkit.Subscribe) receives: a marker published on
// enc now comes after anything enc sent before, so it must come first.
func requireNoneSent(t *testing.T, enc *nats.Conn, subject string, sub <-chan *nats.Msg, what string) {
	t.Helper()
	require.NoError(t, enc.Publish(subject, []byte("marker")))
	require.Equal(t, "marker", string(testkit.Recv(t, sub, 5*time.Second, "the marker").Data), what)
}

func oneRequest(t *testing.T, c *client.Client, r string) {
	t.Helper()
	c.Added(r, 8)
	c.Blocks(r, 0, 0, []uint32{1, 2})
	c.Hashes(r, 0, []byte{1}, []byte{2})
	c.Tokens(r, 8, 8)
	require.NoError(t, c.Flush())
	c.Finished(r, false, 8, 8)
	require.NoError(t, c.Flush())
}

// After Close the engine is unregistered: a Lookup fails at once and
// sends nothing, as a Load does (before, it asked the node, which
// answered "unknown engine").
func TestLookupAfterCloseSendsNothing(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	lookups := testkit.Subscribe(t, nc, "kvactors.e1.lookup")
	enc := dial(t, s.ClientURL(), "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec()})
	require.NoError(t, c.Close())
	_, err := c.Lookup(context.Background(), []string{"01"})
	require.ErrorContains(t, err, "lookup after Close")
	requireNoneSent(t, enc, "kvactors.e1.lookup", lookups, "a lookup was published after Close")
}

// TestConnectRetriesUntilANodeAnswers: no node at first (the register
// request times out); Connect keeps trying and succeeds once one starts.
func TestConnectRetriesUntilANodeAnswers(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	attempts := testkit.Subscribe(t, nc, "kvactors.e1.register")
	enc := dial(t, s.ClientURL(), "e1")
	done := make(chan error, 1)
	var c *client.Client
	go func() {
		var err error
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err = client.Connect(ctx, enc, client.Config{Engine: "e1", Spec: spec(), RequestTimeout: 100 * time.Millisecond})
		done <- err
	}()
	testkit.Recv(t, attempts, 5*time.Second, "a first register attempt")
	testkit.Recv(t, attempts, 5*time.Second, "a retried register attempt")
	startFakeNode(t, nc, "n1", "boot1", testLease)
	require.NoError(t, testkit.Recv(t, done, 10*time.Second, "Connect"))
	st := c.Stats()
	require.Equal(t, "n1", st.Node)
	require.Equal(t, "boot1", st.Boot)
	require.NoError(t, c.Close())
}

// TestConnectStopsOnRefusal: a register the node refuses is an error at
// once, not retried until the context ends.
func TestConnectStopsOnRefusal(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	f.refuse = "bad_spec: no"
	_, err := client.Connect(context.Background(), dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	require.ErrorContains(t, err, "bad_spec: no")
}

// TestInboxPrefixIsPerEngine: replies come to _INBOX.<engine>.…, which is
// what NATS permissions confine an engine to.
func TestInboxPrefixIsPerEngine(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	inboxes := make(chan string, 16)
	sub, err := nc.Subscribe("kvactors.e1.register", func(m *nats.Msg) {
		inboxes <- m.Reply
		_ = m.Respond([]byte(`{"ok":true,"node":"n1","boot":"b","lease_ms":400}`))
	})
	require.NoError(t, err)
	defer func() { _ = sub.Unsubscribe() }()
	connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	require.Regexp(t, `^_INBOX\.e1\.`, testkit.Recv(t, inboxes, 5*time.Second, "the register's reply subject"))
}

// A connection on another inbox prefix is refused at Connect, at once and
// saying why, before anything is sent: the node would answer none of the
// engine's requests (PROTOCOL.md "kvactors' choice, replies").
func TestConnectRefusesAConnectionOnAnotherInbox(t *testing.T) {
	t.Parallel()
	s, _ := testkit.NATS(t)
	for _, opts := range [][]nats.Option{nil, {nats.CustomInboxPrefix(client.InboxPrefix("e2"))}} {
		nc, err := nats.Connect(s.ClientURL(), opts...)
		require.NoError(t, err)
		t.Cleanup(nc.Close)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err = client.Connect(ctx, nc, client.Config{Engine: "e1", Spec: spec()})
		cancel()
		require.ErrorIs(t, err, client.ErrConfig)
		require.ErrorContains(t, err, `want "_INBOX.e1"`)
	}
}

// TestReleasedOncePerEventInCurrentEpoch: a finished request is freed
// once, by the node's release for the current epoch; a release carrying
// another epoch frees nothing.
func TestReleasedOncePerEventInCurrentEpoch(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	c.Added("stale", 8)
	c.Blocks("stale", 0, 0, []uint32{3})
	c.Finished("stale", false, 4, 8)
	// A release for an old epoch must not free "stale": published before
	// the batch, so it is surely handled before r1's release.
	require.NoError(t, nc.Publish("kvactors.e1.released",
		[]byte(`{"request":"stale","epoch":"old","rseq":1,"reason":"finished"}`)))
	oneRequest(t, c, "r1")
	first := testkit.Recv(t, rels.ch, 5*time.Second, "the first release")
	second := testkit.Recv(t, rels.ch, 5*time.Second, "the second release")
	require.ElementsMatch(t, []string{"stale", "r1"}, []string{first.Request, second.Request})
	for _, rel := range []client.Release{first, second} {
		require.Equal(t, messages.ReasonFinished, rel.Reason)
		require.Equal(t, c.Epoch(), rel.Epoch)
	}
	testkit.NoRecv(t, rels.ch, 2*testLease, "a second release")
	st := c.Stats()
	require.Equal(t, 1, st.StaleReleases)
	require.Zero(t, st.Awaiting)
	require.Zero(t, st.Live)
}

// TestDroppedBatchIsResynced injects the loss of one batch in the
// transport: the node sees the gap, asks for a resync, and the new epoch
// re-announces the request from the mirror (hashes and blocks from 0), so
// it is released exactly once, in the new epoch.
func TestDroppedBatchIsResynced(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on,
		DropBatch: func(seq uint64) bool { return seq == 2 }})
	first := c.Epoch()
	c.Added("r1", 8)
	require.NoError(t, c.Flush())
	c.Blocks("r1", 0, 0, []uint32{1, 2})
	c.Hashes("r1", 0, []byte{1}, []byte{2})
	c.Tokens("r1", 8, 8)
	require.NoError(t, c.Flush()) // seq 2: dropped
	c.Finished("r1", false, 8, 8)
	require.NoError(t, c.Flush()) // seq 3: a gap
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "the release of r1")
	require.Equal(t, "r1", rel.Request)
	require.NotEqual(t, first, rel.Epoch)
	require.Equal(t, c.Epoch(), rel.Epoch)
	testkit.NoRecv(t, rels.ch, 2*testLease, "a second release of r1")
	var types []string
	for _, ev := range f.events(rel.Epoch) {
		types = append(types, fmt.Sprintf("%s@%d", ev.Type, ev.Start))
	}
	require.Equal(t, []string{"added@0", "hashes@0", "blocks@0", "finished@0"}, types)
	st := c.Stats()
	require.Equal(t, 1, st.DroppedBatches)
	require.Equal(t, 1, st.Resyncs["resync"])
	resyncs, _ := f.counts()
	require.GreaterOrEqual(t, resyncs, 1) // a heartbeat of the old epoch may repeat it
}

// firstOnly holds back the very first release of the test (the fake node
// calls it under its lock).
func firstOnly() func(uint64) bool {
	held := false
	return func(uint64) bool {
		defer func() { held = true }()
		return !held
	}
}

// TestLostTailIsResynced drops the last batch (the finished event): only
// the heartbeat's seq shows the node what it missed.
func TestLostTailIsResynced(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on,
		DropBatch: func(seq uint64) bool { return seq == 2 }})
	oneRequest(t, c, "r1")
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "the release of r1 after the heartbeat")
	require.Equal(t, "r1", rel.Request)
	require.Equal(t, 1, c.Stats().Resyncs["resync"])
}

// TestLostReleaseIsResynced: the node publishes r1's release but the
// engine never receives it. r2's release (rseq 2) shows the gap; the
// resync re-announces r1, whose release then arrives in the new epoch.
func TestLostReleaseIsResynced(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	f.holdRelease = firstOnly()
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	first := c.Epoch()
	oneRequest(t, c, "r1")
	oneRequest(t, c, "r2")
	got := map[string]client.Release{}
	for range 2 {
		rel := testkit.Recv(t, rels.ch, 5*time.Second, "releases of r1 and r2")
		got[rel.Request] = rel
	}
	require.Equal(t, first, got["r2"].Epoch)
	require.NotEqual(t, first, got["r1"].Epoch)
	testkit.NoRecv(t, rels.ch, 2*testLease, "a third release")
	require.Equal(t, 1, c.Stats().Resyncs["lost_release"])
}

// TestLostLastReleaseIsResynced: the only release is lost, so no rseq gap
// shows it: the heartbeat reply's released count does.
func TestLostLastReleaseIsResynced(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	f.holdRelease = firstOnly()
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	first := c.Epoch()
	oneRequest(t, c, "r1")
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "the release of r1 after two heartbeats")
	require.NotEqual(t, first, rel.Epoch)
	require.Equal(t, 1, c.Stats().Resyncs["lost_release"])
}

// TestAnUnnumberedReleaseInAV2SessionIsDropped: a node with a boot (v2)
// numbers every release (epoch and rseq), so one without an epoch or an
// rseq is not a v1 node's: it is dropped and counted, frees nothing, and
// is not counted against the heartbeat's released, where it would mask
// the lost release it stands beside (PROTOCOL.md engine checklist, step
// 10). r1's only release is lost; the resync the heartbeat reply shows it
// needs frees r1 in the new epoch.
func TestAnUnnumberedReleaseInAV2SessionIsDropped(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	f.holdRelease = firstOnly()
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	first := c.Epoch()
	oneRequest(t, c, "r1")
	// On the fake node's connection, so both are handled before its later
	// release of r1 (one publisher, one subscription: in order).
	for _, body := range []string{`{"request":"r1","reason":"finished"}`,
		`{"request":"r1","epoch":"` + first + `","reason":"finished"}`} {
		require.NoError(t, nc.Publish("kvactors.e1.released", []byte(body)))
	}
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "the release of r1 after the resync")
	require.Equal(t, "r1", rel.Request)
	require.NotEmpty(t, rel.Epoch)
	require.NotEqual(t, first, rel.Epoch, "freed in the resync's epoch, not by an unnumbered release")
	st := c.Stats()
	require.Equal(t, 2, st.UnnumberedRel)
	require.Equal(t, 1, st.Resyncs["lost_release"])
}

// TestNodeLossFreesAfterLeaseThenResyncs kills the node (no reply, no
// heartbeat) while r1 awaits its release and r2 runs: r1 is freed with
// node_lost no sooner than the lease after the node's last sign of life
// and no later than lease + 1 s after its death; a new boot of the node
// gets a register and a new epoch re-announcing r2.
func TestNodeLossFreesAfterLeaseThenResyncs(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	f.holdRelease = func(uint64) bool { return true } // nothing is released before the death
	beats := testkit.Subscribe(t, nc, "kvactors._node.n1.heartbeat")
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	c.Added("r2", 8)
	c.Blocks("r2", 0, 0, []uint32{5})
	require.NoError(t, c.Flush())
	oneRequest(t, c, "r1")
	testkit.Recv(t, beats, 5*time.Second, "a node heartbeat")
	f.kill()
	died := time.Now()
	lastBeat := f.lastHeartbeat() // no client saw it sooner; a later reply only delays the free
	rel := testkit.Recv(t, rels.ch, testLease+time.Second, "r1 freed by node loss")
	freed := time.Since(died)
	require.Equal(t, "r1", rel.Request)
	require.Equal(t, messages.ReasonNodeLost, rel.Reason)
	require.GreaterOrEqual(t, time.Since(lastBeat), testLease, "freed sooner than the lease after the last heartbeat")
	t.Logf("freed %v after the node died (lease %v)", freed, testLease)
	require.Equal(t, 1, c.Stats().NodeLosses)

	f2 := startFakeNode(t, nc, "n1", "boot2", testLease)
	testkit.Eventually(t, 5*time.Second, 20*time.Millisecond, func() error {
		if st := c.Stats(); st.Boot != "boot2" || st.Resyncs["new_boot"] != 1 {
			return fmt.Errorf("boot %s, resyncs %v", st.Boot, st.Resyncs)
		}
		if evs := f2.events(c.Epoch()); len(evs) < 2 || evs[0].Request != "r2" {
			return fmt.Errorf("new node saw %v", evs)
		}
		return nil
	})
	testkit.NoRecv(t, rels.ch, 2*testLease, "another release")
	// Closed while f2 lives: in cleanup, f2 is killed first, and an
	// unregister racing its unsubscribe would wait out RequestTimeout.
	require.NoError(t, c.Close())
}

// TestPreemptedResyncStates: a resync re-announces each phase as the
// protocol says, and a preempted request whose blocks were already freed
// is re-announced without its blocks, its new release absorbed silently.
func TestPreemptedResyncStates(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	c.Added("p", 8)
	c.Blocks("p", 0, 0, []uint32{1, 2})
	c.Tokens("p", 8, 8)
	c.Preempted("p")
	require.NoError(t, c.Flush())
	require.Equal(t, messages.ReasonPreempted, testkit.Recv(t, rels.ch, 5*time.Second, "p preempted").Reason)
	c.Resync()
	require.NoError(t, c.Flush())
	var types []string
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		types = types[:0]
		for _, ev := range f.events(c.Epoch()) {
			types = append(types, ev.Type.String())
		}
		if len(types) < 3 {
			return fmt.Errorf("new epoch: %v", types)
		}
		return nil
	})
	require.Equal(t, []string{"added", "tokens", "preempted"}, types)
	testkit.NoRecv(t, rels.ch, 2*testLease, "a release for the re-announced preemption")
	c.Resumed("p")
	c.Blocks("p", 0, 0, []uint32{7})
	c.Finished("p", true, 4, 8)
	require.NoError(t, c.Flush())
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "p aborted")
	require.Equal(t, messages.ReasonAborted, rel.Reason)
}

// TestCloseUnregistersAndStops: Close sends unregister, no callback runs
// afterwards and the client's goroutines are gone.
func TestCloseUnregistersAndStops(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	enc := dial(t, s.ClientURL(), "e1")
	// A first session creates what the connection keeps for its life (the
	// request/reply inbox subscription); the second must leave nothing.
	require.NoError(t, connect(t, enc, client.Config{Engine: "e1", Spec: spec()}).Close())
	base := runtime.NumGoroutine()
	closed := make(chan struct{})
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec(), OnReleased: func(client.Release) {
		select {
		case <-closed:
			t.Error("a callback after Close")
		default:
		}
	}})
	c.Added("r1", 8)
	c.Blocks("r1", 0, 0, []uint32{1})
	require.NoError(t, c.Flush())
	require.NoError(t, c.Close())
	close(closed)
	_, unregisters := f.counts()
	require.Equal(t, 2, unregisters)
	require.Error(t, c.Flush())
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if n := runtime.NumGoroutine(); n > base {
			return fmt.Errorf("%d goroutines, %d before Connect", n, base)
		}
		return nil
	})
}

// TestResumeBeforeReleaseOwesTwo: preempted, resumed with other blocks and
// finished before either release arrived, then both releases are lost:
// the resync re-announces a preemption and the finish, and the engine gets
// exactly the two releases it is owed, in order, in the new epoch.
func TestResumeBeforeReleaseOwesTwo(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	n := 0
	f.holdRelease = func(uint64) bool { n++; return n <= 2 }
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	first := c.Epoch()
	c.Added("p", 8)
	c.Blocks("p", 0, 0, []uint32{1, 2})
	c.Tokens("p", 8, 8)
	c.Preempted("p")
	require.NoError(t, c.Flush())
	c.Resumed("p")
	c.Blocks("p", 0, 0, []uint32{3, 4})
	c.Finished("p", false, 8, 8)
	require.NoError(t, c.Flush())
	a := testkit.Recv(t, rels.ch, 5*time.Second, "the first release")
	b := testkit.Recv(t, rels.ch, 5*time.Second, "the second release")
	require.Equal(t, []string{messages.ReasonPreempted, messages.ReasonFinished}, []string{a.Reason, b.Reason})
	require.NotEqual(t, first, a.Epoch)
	require.Equal(t, a.Epoch, b.Epoch)
	testkit.NoRecv(t, rels.ch, 2*testLease, "a third release")
	require.Zero(t, c.Stats().Live)
}

// TestForgottenEngineRegistersAgain: the node drops the engine (as an
// expiry would) without the engine hearing of it; the heartbeat's
// "unknown engine" makes the client register again and re-announce the
// request it still runs, in a new epoch.
func TestForgottenEngineRegistersAgain(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	first := c.Epoch()
	c.Added("r1", 8)
	c.Blocks("r1", 0, 0, []uint32{1})
	require.NoError(t, c.Flush())
	f.mu.Lock()
	f.registered, f.reqs = false, map[string]bool{}
	f.mu.Unlock()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		epoch := c.Epoch()
		if epoch == first {
			return fmt.Errorf("still on the first epoch")
		}
		if evs := f.events(epoch); len(evs) < 2 || evs[0].Request != "r1" {
			return fmt.Errorf("the node saw %v in the new epoch", evs)
		}
		return nil
	})
	st := c.Stats()
	require.Equal(t, 2, st.Registers)
	require.Equal(t, 1, st.Resyncs["reregister"])
	require.Zero(t, st.NodeLosses)
}

// The heartbeat's "unknown engine" wakes the session to register again at
// once, not at its next tick a period later: until it has, the engine's
// batches are dropped and its loads refused.
func TestForgottenEngineRegistersAgainAtOnce(t *testing.T) {
	t.Parallel()
	const lease = 4 * time.Second // a heartbeat period of 1 s
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", lease)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	first := c.Epoch()
	beats := testkit.Subscribe(t, nc, "kvactors.e1.heartbeat")
	registers := testkit.Subscribe(t, nc, "kvactors.e1.register")
	f.mu.Lock()
	f.registered, f.reqs = false, map[string]bool{}
	f.mu.Unlock()
	testkit.Recv(t, beats, 3*time.Second, "a heartbeat, answered unknown engine")
	testkit.Recv(t, registers, 500*time.Millisecond, "a register within half a period of the answer")
	testkit.Eventually(t, 2*time.Second, 5*time.Millisecond, func() error {
		if c.Epoch() == first {
			return fmt.Errorf("still on the first epoch")
		}
		return nil
	})
}

// TestOwnReconnectResyncs restarts the NATS server under the engine: after
// its connection comes back the client starts a new epoch (whatever was in
// flight may be lost).
func TestOwnReconnectResyncs(t *testing.T) {
	t.Parallel()
	s := testkit.NATSServer(t)
	url := s.ClientURL()
	nc := testkit.Connect(t, s)
	startFakeNode(t, nc, "n1", "boot1", 2*time.Second)
	enc := dial(t, url, "e1")
	c := connect(t, enc, client.Config{Engine: "e1", Spec: spec()})
	first := c.Epoch()
	// Dropping the engine's connection from the server side is a
	// reconnect for the client, with the server (and the node) still up.
	conns, err := s.Connz(nil)
	require.NoError(t, err)
	for _, ci := range conns.Conns {
		if ci.Name == "kvactors-engine-e1" {
			s.DisconnectClientByID(ci.Cid)
		}
	}
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if c.Epoch() == first || c.Stats().Resyncs["reconnect"] != 1 {
			return fmt.Errorf("resyncs %v", c.Stats().Resyncs)
		}
		return nil
	})
}

// TestCloseDuringLeaseWait: a node lost by silence while the engine kept
// publishing makes the client wait out the lease from its last publish
// before freeing (the node may have heard that publish); Close during that
// wait returns at once.
func TestCloseDuringLeaseWait(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	const lease = 2 * time.Second
	f := startFakeNode(t, nc, "n1", "boot1", lease)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	f.kill()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(3 * lease)
	for n := 0; c.Stats().NodeLosses == 0; n++ { // each flush before the loss moves the frees later
		c.Added(fmt.Sprintf("r%d", n), 4)
		require.NoError(t, c.Flush())
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatal("no node loss after 3 leases of silence")
		}
	}
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	require.NoError(t, testkit.Recv(t, closed, time.Second, "Close during the lease wait"))
}

// TestConcurrentUse drives one client from several goroutines at once
// (each its own requests, each flushing) while Stats and Resync are called
// too: under -race this checks the documented safety, and every request
// is released exactly once.
func TestConcurrentUse(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", testLease)
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on})
	const workers, each = 4, 25
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				r := fmt.Sprintf("w%d-r%d", w, i)
				c.Added(r, 8)
				c.Blocks(r, 0, 0, []uint32{uint32(w*each + i + 1)})
				c.Tokens(r, 4, 8)
				_ = c.Flush()
				c.Finished(r, false, 4, 8)
				_ = c.Flush()
				if i%10 == 0 {
					_ = c.Stats()
				}
			}
		})
	}
	wg.Go(func() { c.Resync() })
	wg.Wait()
	require.NoError(t, c.Flush())
	seen := map[string]int{}
	for range workers * each {
		rel := testkit.Recv(t, rels.ch, 10*time.Second, "a release")
		seen[rel.Request]++
	}
	testkit.NoRecv(t, rels.ch, 2*testLease, "a release beyond one per request")
	require.Len(t, seen, workers*each)
	for r, n := range seen {
		require.Equal(t, 1, n, "request %s", r)
	}
}

// TestLostTailWithoutResyncMessage drops the last batch and every resync
// message the node sends: the heartbeat replies alone (applied stays below
// what was published) make the client resync.
func TestLostTailWithoutResyncMessage(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	f.muteResync = true
	rels := newReleases()
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rels.on,
		DropBatch: func(seq uint64) bool { return seq == 2 }})
	oneRequest(t, c, "r1")
	rel := testkit.Recv(t, rels.ch, 5*time.Second, "the release of r1 after the client saw the lost tail")
	require.Equal(t, "r1", rel.Request)
	require.Equal(t, 1, c.Stats().Resyncs["lost_tail"])
}
