package node

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// logWatch is a slog.Handler that reports each record whose message is msg
// (whatever its attributes) and drops everything.
type logWatch struct {
	msg  string
	seen chan string
}

func (h logWatch) Enabled(context.Context, slog.Level) bool { return true }
func (h logWatch) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h logWatch) WithGroup(string) slog.Handler            { return h }
func (h logWatch) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		select {
		case h.seen <- r.Message:
		default:
		}
	}
	return nil
}

// startWatched starts a node (lease 0: the default) whose log goes to watch,
// and a client of its embedded NATS; dir is its shm directory.
func startWatched(t *testing.T, lease time.Duration, watch logWatch) (*Node, *nats.Conn, string) {
	t.Helper()
	return startInternal(t, func(c *Config) { c.Lease, c.Log = lease, slog.New(watch) })
}

// startInternal starts a node on an embedded NATS (1 MiB pool, no admin
// HTTP, logs dropped) as edit (nil: none) changes it, and a client of its
// NATS; dir is its shm directory.
func startInternal(t *testing.T, edit func(*Config)) (n *Node, nc *nats.Conn, dir string) {
	t.Helper()
	dir = t.TempDir()
	cfg := Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir, PoolBytes: 1 << 20, HTTPAddr: "off",
		Log: slog.New(logWatch{})}
	if edit != nil {
		edit(&cfg)
	}
	n, err := Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err = nats.Connect(n.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return n, nc, dir
}

// segments numbers the shm segments registerOneEngine makes, so each
// register, of one id again too, has a spec of its own.
var segments atomic.Int64

// registerOneEngine registers engine id (one shm segment of 4 blocks of
// 1 KiB, chunks of one block; a new segment each time, so a new spec) over
// nc.
func registerOneEngine(t *testing.T, nc *nats.Conn, dir, id string) {
	t.Helper()
	require.NoError(t, tryRegister(t, nc, dir, id))
}

// takeWholeBudget fills the intake budget, once the messages before it are
// done with theirs: a request's reply is sent while its message still holds
// its bytes, returned just after (ingester.work), so the budget is taken
// whole only once those come back. freeTotal gives it back.
func takeWholeBudget(t *testing.T, in *ingester) int64 {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if holdTotal(in, in.budget) {
			return nil
		}
		return fmt.Errorf("intake holds %d bytes", in.pending.Load())
	})
	return in.budget
}

// tryRegister is registerOneEngine's work, for any goroutine: its error
// says what failed.
func tryRegister(t *testing.T, nc *nats.Conn, dir, id string) error {
	seg, err := shm.Create(dir, fmt.Sprintf("%s-kv%d", id, segments.Add(1)), 4096)
	if err != nil {
		return err
	}
	t.Cleanup(func() { _ = seg.Remove() })
	spec, _ := json.Marshal(messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 4,
		Segments: []messages.Segment{seg.Spec()}, Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 1024, BlockBytes: 1024}}}}})
	reply, err := testkit.EngineRequest(nc, id, "kvactors."+id+".register", spec, 5*time.Second)
	if err != nil {
		return err
	}
	if !strings.Contains(string(reply.Data), `"ok":true`) {
		return fmt.Errorf("register refused: %s", reply.Data)
	}
	return nil
}

// The node wires each engine actor's lease check to its intake shard
// (engine.Deps.Backlogged): an engine silent for a lease whose shard holds
// messages taken off NATS and not yet handled (its own signs of life,
// perhaps) is not expired; once they are handled it lives on. The shard is
// held by holding the ingester's routing lock, which the decode worker
// takes for a batch (lookup) before the engine actor sees it: the worker
// stops at the engine's first batch and the second waits in the queue.
func TestAnEngineWithMessagesWaitingInItsShardDoesNotExpire(t *testing.T) {
	t.Parallel()
	const lease = 2 * time.Second
	expired := make(chan string, 1)
	n, nc, dir := startWatched(t, lease, logWatch{msg: "engine expired: no sign of life for a lease", seen: expired})
	in := n.ingest

	begun := time.Now() // the engine's silence begins after this
	registerOneEngine(t, nc, dir, "e1")
	in.mu.Lock()
	release := sync.OnceFunc(in.mu.Unlock)
	t.Cleanup(release) // before Close (cleanups run last first)
	for seq := 1; seq <= 2; seq++ {
		require.NoError(t, nc.Publish("kvactors.e1.events", fmt.Appendf(nil, `{"epoch":"a","seq":%d,"events":[]}`, seq)))
	}
	require.NoError(t, nc.Flush())
	shard := in.queues[in.shard("e1")]
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if len(shard) == 0 {
			return fmt.Errorf("nothing waits in e1's shard yet")
		}
		return nil
	})
	require.Less(t, time.Since(begun), lease, "set up too slowly for the window below to hold a lease check")
	// From begun+lease the engine has been silent for a lease, and its lease
	// check runs every lease/4 (from the node's start, just before begun);
	// without the backlog it expires at the first one. With it, it may only
	// expire at 2 leases of silence. The window ends between two checks,
	// before the release below drains the shard.
	testkit.NoRecv(t, expired, time.Until(begun.Add(13*lease/8)), "the engine expiring while its shard holds its batches")

	release()
	st, err := nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(st.Data), `"seq":2`, "both batches applied: the engine lives on")
	require.Zero(t, testutil.ToFloat64(n.metrics.Expired))
	testkit.NoRecv(t, expired, 0, "an expiry")
}

// A sign of life the decode worker holds (taken off the shard's queue, not
// yet handed to the engine actor) is as much a message "taken off NATS and
// not yet handled" (PROTOCOL.md "Engine liveness") as one still queued: the
// lease check reads the shard's marks too (ingester.backlogged). The worker
// is held there as above, with a single batch, so the queue is empty.
func TestASignOfLifeInTheDecodeWorkersHandsIsABacklog(t *testing.T) {
	t.Parallel()
	const lease = 2 * time.Second
	expired := make(chan string, 1)
	n, nc, dir := startWatched(t, lease, logWatch{msg: "engine expired: no sign of life for a lease", seen: expired})
	in := n.ingest

	begun := time.Now()
	registerOneEngine(t, nc, dir, "e1")
	in.mu.Lock()
	release := sync.OnceFunc(in.mu.Unlock)
	t.Cleanup(release)
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":1,"events":[]}`)))
	require.NoError(t, nc.Flush())
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if p := in.pending.Load(); p == 0 {
			return fmt.Errorf("the batch is not taken yet")
		}
		return nil
	})
	testkit.NoRecv(t, expired, time.Until(begun.Add(13*lease/8)), "the engine expiring while the worker holds its batch")
	release()
	st, err := nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(st.Data), `"seq":1`, "the batch applied: the engine lives on")
}

// Messages nats.go holds for the intake's subscription, not yet seen by take
// (it is busy, or held), name no engine yet: the lease check counts them as
// every engine's backlog.
func TestMessagesTheSubscriptionHoldsAreEveryEnginesBacklog(t *testing.T) {
	t.Parallel()
	n, nc, dir := startWatched(t, 0, logWatch{})
	in := n.ingest
	registerOneEngine(t, nc, dir, "e1")
	// The register's reply goes out from inside its handling, and the
	// worker marks the message handled just after: wait for that.
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if in.backlogged("e1") {
			return fmt.Errorf("the register still counts as e1's backlog")
		}
		return nil
	})

	in.gate.Lock() // take waits at its first message: that one and the next stay the subscription's
	release := sync.OnceFunc(in.gate.Unlock)
	t.Cleanup(release)
	for seq := 1; seq <= 2; seq++ {
		require.NoError(t, nc.Publish("kvactors.e1.events", fmt.Appendf(nil, `{"epoch":"a","seq":%d,"events":[]}`, seq)))
	}
	require.NoError(t, nc.Flush())
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if msgs, _, _ := in.sub.Pending(); msgs < 2 {
			return fmt.Errorf("%d messages pending for the subscription", msgs)
		}
		return nil
	})
	require.True(t, in.backlogged("e1"))
	require.True(t, in.backlogged("some-other-engine"), "a message not yet taken names no engine")
	release()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if in.backlogged("e1") {
			return fmt.Errorf("still a backlog")
		}
		return nil
	})
}

// An expiry ends the engine of the actor that expired, not whatever has the
// id by the time the node acts: an engine that registered again meanwhile
// (a new spec: a new actor) lives on.
func TestAnExpiryEndsOnlyTheActorThatExpired(t *testing.T) {
	t.Parallel()
	n, nc, dir := startWatched(t, 0, logWatch{})
	registerOneEngine(t, nc, dir, "e1")
	old := n.engine("e1")
	require.NotNil(t, old)

	registerOneEngine(t, nc, dir, "e1") // a new spec: a new actor
	cur := n.engine("e1")
	require.NotNil(t, cur)
	require.False(t, cur.pid.Equal(old.pid), "a new spec: a new actor")

	require.False(t, n.expired("e1", old.pid), "the old actor's report, arriving late")
	require.Same(t, cur, n.engine("e1"), "the engine registered again was ended")
	select { // the new spec's register retired the old actor itself
	case <-old.closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the old engine actor did not stop")
	}
	st, err := nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.NotContains(t, string(st.Data), `"ok":false`)
}

// An engine whose messages the node drops because its intake is full is
// alive all the same (PROTOCOL.md "Engine liveness": a batch, even one that
// is dropped, or a heartbeat is a sign of life): overload never expires
// it. The full intake is injected by taking the whole budget; for two
// leases the engine keeps sending heartbeats (each refused, overloaded), or
// batches. A status, which a router may send as well, is no sign of life:
// polled through the overload, the engine still expires.
func TestAnEngineTheNodeIsTooBusyToHearIsAlive(t *testing.T) {
	t.Parallel()
	const lease = time.Second
	heartbeat := func(t *testing.T, nc *nats.Conn) {
		reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.heartbeat", []byte(`{"epoch":"a","seq":0}`), 5*time.Second)
		require.NoError(t, err)
		require.Contains(t, string(reply.Data), "overloaded")
	}
	batch := func(t *testing.T, nc *nats.Conn) {
		require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":1,"events":[]}`)))
		require.NoError(t, nc.Flush())
	}
	status := func(t *testing.T, nc *nats.Conn) {
		reply, err := nc.Request("kvactors.e1.status", []byte(`{}`), 5*time.Second)
		require.NoError(t, err)
		require.Contains(t, string(reply.Data), "overloaded")
	}
	for _, tc := range []struct {
		name   string
		send   func(*testing.T, *nats.Conn)
		expire bool
	}{
		{"heartbeats", heartbeat, false},
		{"batches", batch, false},
		{"status requests", status, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			expired := make(chan string, 1)
			n, nc, dir := startWatched(t, lease, logWatch{msg: "engine expired: no sign of life for a lease", seen: expired})
			registerOneEngine(t, nc, dir, "e1")
			in := n.ingest
			taken := takeWholeBudget(t, in)
			t.Cleanup(sync.OnceFunc(func() { freeTotal(in, taken) }))

			tick := time.NewTicker(lease / 5)
			defer tick.Stop()
			window := 2 * lease
			if tc.expire {
				window = 3 * lease // a backlog may defer an expiry to 2 leases of silence, and the check runs every lease/4
			}
			for end := time.Now().Add(window); time.Now().Before(end); {
				select {
				case e := <-expired:
					if tc.expire {
						return
					}
					t.Fatalf("%s while it kept sending to a full intake", e)
				case <-tick.C:
				}
				tc.send(t, nc)
			}
			if tc.expire {
				t.Fatal("an engine only polled through the overload did not expire in three leases")
			}
			testkit.NoRecv(t, expired, 0, "an expiry")
		})
	}
}

// A sign of life the full intake drops dates from the drop, not from when
// flushLost tells the engine actor (up to lease/4 later, on the session
// loop): PROTOCOL.md "Engine liveness" bounds expiry by the last sign of
// life, so an engine that falls silent under overload expires a lease after
// its last dropped message, not a lease after the node got round to it. Two
// drops: the later one counts. A heartbeat's drop reaches the actor as a
// Touch, a batch's as a Lost. The node's liveness clock is a fake; the
// engine's lease checks are Ticks sent by hand at chosen times (the lease is
// long, so the session loop's own ticks and flushes come too late to
// interfere).
func TestADroppedSignOfLifeIsStampedWhenItWasDropped(t *testing.T) {
	t.Parallel()
	const lease = time.Minute
	start := time.Unix(1_800_000_000, 0)
	heartbeat := func(t *testing.T, _ *Node, nc *nats.Conn, _ int) {
		reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.heartbeat", []byte(`{"epoch":"a","seq":0}`), 5*time.Second)
		require.NoError(t, err)
		require.Contains(t, string(reply.Data), "overloaded") // recorded before the reply
	}
	batch := func(t *testing.T, n *Node, nc *nats.Conn, drops int) {
		require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":1,"events":[]}`)))
		require.NoError(t, nc.Flush())
		testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
			if v := testutil.ToFloat64(n.metrics.DroppedBatches.WithLabelValues("overflow")); v != float64(drops) {
				return fmt.Errorf("overflow drops %v, want %d", v, drops)
			}
			return nil
		})
	}
	for _, tc := range []struct {
		name string
		drop func(t *testing.T, n *Node, nc *nats.Conn, drops int)
	}{
		{"heartbeat", heartbeat},
		{"batch", batch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var clock atomic.Int64
			clock.Store(start.UnixNano())
			set := func(d time.Duration) { clock.Store(start.Add(d).UnixNano()) }
			expired := make(chan string, 1)
			n, nc, dir := startInternal(t, func(c *Config) {
				c.Lease = lease
				c.Log = slog.New(logWatch{msg: "engine expired: no sign of life for a lease", seen: expired})
				c.now = func() time.Time { return time.Unix(0, clock.Load()) }
			})
			registerOneEngine(t, nc, dir, "e1") // its sequencer starts at start
			in := n.ingest
			pid := n.engine("e1").pid
			require.NotNil(t, pid)

			taken := takeWholeBudget(t, in)
			set(lease / 4)
			tc.drop(t, n, nc, 1)
			set(lease / 2) // the last sign of life
			tc.drop(t, n, nc, 2)
			freeTotal(in, taken)
			set(3 * lease / 4) // told a quarter lease late
			in.flushLost()

			// A check confirms an expiry behind a message it sends itself:
			// two status queries later, what it found is done (an expired
			// engine ends, and may answer no more).
			set(lease/2 + lease - time.Nanosecond)
			n.system.Root.Send(pid, &engine.Tick{})
			for range 2 {
				ch := make(chan engine.Status, 1)
				n.system.Root.Send(pid, &engine.StatusQuery{Reply: ch})
				select {
				case <-ch:
				case e := <-expired:
					t.Fatalf("%s under a lease after the last dropped sign of life", e)
				case <-time.After(5 * time.Second):
					t.Fatal("timed out waiting for the engine's status")
				}
			}
			testkit.NoRecv(t, expired, 0, "an expiry under a lease after the last dropped sign of life")
			set(lease/2 + lease)
			n.system.Root.Send(pid, &engine.Tick{})
			testkit.Recv(t, expired, 5*time.Second, "the expiry a lease after the last dropped sign of life (not a lease after it was told)")
		})
	}
}
