package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strconv"
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

// Two processes must never share a node id (PROTOCOL.md "Node identity"):
// a node started with the id of one running on the same NATS refuses to
// start, naming the running one's boot; one started beside it anyway (the
// probe skipped) is heard by its hello and heartbeats: counted, and the
// running node's /readyz fails until a lease after the last one. Once the
// first is gone, its id starts again at once.
func TestANodeIDServedByARunningProcessIsRefused(t *testing.T) {
	t.Parallel()
	s := testkit.NATSServer(t)
	const lease = 400 * time.Millisecond
	shared := func(id string) func(*node.Config) {
		return func(c *node.Config) { c.NATSURL, c.NodeID, c.Lease = s.ClientURL(), id, lease }
	}
	a := startNode(t, shared("dup"))

	_, err := node.Start(context.Background(), idConfig(s.ClientURL(), "dup", lease, t.TempDir()))
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), a.node.Boot(), "the refusal names the running boot")
	readyWithoutConflict(t, a.node.Ready, "a refused start is no conflict for the running node")
	require.Zero(t, a.counter("kvactors_node_id_conflicts_total", ""))

	other := startNode(t, shared("other")) // another id on the same NATS starts
	readyWithoutConflict(t, other.node.Ready, "another id")

	b := startNode(t, shared("dup"), func(c *node.Config) { c.SkipNodeIDCheck = true })
	for _, e := range []*env{a, b} { // each hears the other's hello or heartbeat
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			err := e.node.Ready()
			if err == nil || !strings.Contains(err.Error(), "also in use") {
				return fmt.Errorf("ready: %v", err)
			}
			return nil
		})
		require.Positive(t, e.counter("kvactors_node_id_conflicts_total", ""))
	}
	readyWithoutConflict(t, other.node.Ready, "another id hears nothing of it")
	require.Zero(t, other.counter("kvactors_node_id_conflicts_total", ""))

	require.NoError(t, b.node.Close(context.Background()))
	testkit.Eventually(t, 5*lease, 10*time.Millisecond, a.node.Ready) // a lease after the last heartbeat

	require.NoError(t, a.node.Close(context.Background()))
	c := startNode(t, shared("dup")) // the id is free again: no wait
	readyWithoutConflict(t, c.node.Ready, "the id started again")
}

// readyWithoutConflict waits until ready (a node's Ready) reports nothing
// wrong, and fails at once if it reports the node id in use. Ready checks
// the fence (no round trip for lease/2: 200 ms at these tests' 400 ms
// lease) before the conflict, and a pinger starved on a loaded machine
// makes it report "fenced" for a moment (seen once under two -race suites
// at once): that is waited out, a conflict is not.
func readyWithoutConflict(t *testing.T, ready func() error, what string) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		err := ready()
		if err != nil && strings.Contains(err.Error(), "also in use") {
			t.Fatalf("%s: a node id conflict reported: %v", what, err)
		}
		if err != nil {
			return fmt.Errorf("%s: ready: %w", what, err)
		}
		return nil
	})
}

func idConfig(url, id string, lease time.Duration, dir string) node.Config {
	return node.Config{NATSURL: url, NodeID: id, Lease: lease, HTTPAddr: "off", ShmDir: dir, PoolBytes: 1 << 20}
}

// Two processes starting with one id at the same moment: each answers the
// other's probe before its own probe ends, so exactly one of them starts,
// whatever the interleaving (both seeing each other, the lower boot goes
// on; one seeing the other, the other is past its probe or yields). The
// one refused logs no conflict: it never served.
func TestOfTwoStartingWithOneNodeIDExactlyOneStarts(t *testing.T) { // not parallel: a 400 ms lease's settle delay
	s := testkit.NATSServer(t)
	startTogether(t, []string{s.ClientURL(), s.ClientURL()}, 8)
}

// The same on a 3-server NATS cluster, one process per server: the
// answer's interest reaches the other servers over the routes after the
// probe may have gone out, so the probe asks again after a settle delay.
// KVACTORS_CHAOS_ROUNDS sets the rounds (CI runs more).
func TestOfThreeStartingOnThreeClusterServersExactlyOneStarts(t *testing.T) { // not parallel: a 400 ms lease's settle delay against route latency
	kc := testkit.NATSCluster(t, 3)
	rounds := 6
	if v, err := strconv.Atoi(os.Getenv("KVACTORS_CHAOS_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	startTogether(t, []string{kc.URL(0), kc.URL(1), kc.URL(2)}, rounds)
}

// startTogether starts one node per url with one id, at once, rounds
// times: exactly one must start each round, and none may log a conflict.
func startTogether(t *testing.T, urls []string, rounds int) {
	for round := range rounds {
		id := fmt.Sprintf("twin%d", round)
		var wg sync.WaitGroup
		nodes := make([]*node.Node, len(urls))
		errs := make([]error, len(urls))
		logs := make([]testkit.SyncBuffer, len(urls))
		for i := range nodes {
			cfg := idConfig(urls[i], id, 400*time.Millisecond, t.TempDir())
			cfg.Log = slog.New(slog.NewTextHandler(&logs[i], &slog.HandlerOptions{Level: slog.LevelError}))
			wg.Go(func() { nodes[i], errs[i] = node.Start(context.Background(), cfg) })
		}
		wg.Wait()
		started := 0
		for i, n := range nodes {
			if errs[i] == nil {
				started++
				require.NoError(t, n.Close(context.Background()))
			} else {
				require.ErrorIs(t, errs[i], node.ErrNodeIDInUse, "round %d", round)
			}
			require.NotContains(t, logs[i].String(), "another kvactors process", "round %d: a start is no conflict", round)
		}
		require.Equal(t, 1, started, "round %d: %v", round, errs)
	}
}

// A probe answered by a process that is itself starting: a lower boot goes
// on and this one is refused; a higher boot yields to this one (it heard
// this probe), so this one starts. And a node still in its own probe that
// is asked by a starting process answers as starting, and yields to a
// lower boot: both saw each other.
func TestAStartingProcessYieldsToTheLowerBoot(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	const lease = 400 * time.Millisecond
	answerStarting(t, nc, "low", "0000000000000000")
	_, err := node.Start(context.Background(), idConfig(s.ClientURL(), "low", lease, t.TempDir()))
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), "0000000000000000 is starting with it")

	answerStarting(t, nc, "high", "ffffffffffffffff")
	n, err := node.Start(context.Background(), idConfig(s.ClientURL(), "high", lease, t.TempDir()))
	require.NoError(t, err, "a higher starting boot yields")
	require.NoError(t, n.Close(context.Background()))

	// A node held in its probe by a silent subscriber is asked meanwhile.
	for _, asker := range []struct {
		boot  string
		yield bool
	}{{"0000000000000000", true}, {"ffffffffffffffff", false}} {
		id := "asked" + asker.boot[:1]
		asked := make(chan struct{}, 16)
		_, err := nc.Subscribe("kvactors._node."+id+".identity", func(*nats.Msg) { asked <- struct{}{} })
		require.NoError(t, err)
		require.NoError(t, nc.Flush())
		done := make(chan error, 1)
		go func() {
			n, err := node.Start(context.Background(), idConfig(s.ClientURL(), id, lease, t.TempDir()))
			if err == nil {
				err = n.Close(context.Background())
			}
			done <- err
		}()
		testkit.Recv(t, asked, 5*time.Second, "the node's probe")
		probe, _ := json.Marshal(messages.Hello{Node: id, Boot: asker.boot, LeaseMS: 400})
		// The silent subscriber is on the same subject: gather every answer.
		inbox := nc.NewRespInbox()
		answers, err := nc.SubscribeSync(inbox)
		require.NoError(t, err)
		require.NoError(t, nc.PublishRequest("kvactors._node."+id+".identity", inbox, probe))
		m, err := answers.NextMsg(5 * time.Second)
		require.NoError(t, err)
		var h messages.Hello
		require.NoError(t, json.Unmarshal(m.Data, &h))
		require.True(t, h.Starting, "answered as starting while its own probe runs")
		err = <-done // after the silent wait: no other boot beat
		if asker.yield {
			require.ErrorIs(t, err, node.ErrNodeIDInUse)
			require.Contains(t, err.Error(), asker.boot+" started with it")
		} else {
			require.NoError(t, err, "a higher boot's probe is no reason to yield")
		}
	}
}

// A subscriber on the id's identity subject that never answers is asked
// three times. One that still beats under another boot (a stuck process
// holding the id) refuses the start; one that does not (a process whose
// host is gone, its connection kept by NATS until the server's pings time
// out) lets the node start after a lease, and is a conflict if it comes
// back. One that answers, but not as a node does, refuses the start.
func TestASilentOrStrangeSubscriberOnTheNodeID(t *testing.T) { // not parallel: an answer must land within a 400 ms lease's probe
	s, nc := testkit.NATS(t)
	const lease = 400 * time.Millisecond
	var logs testkit.SyncBuffer
	start := func(id string) (*node.Node, error) {
		cfg := idConfig(s.ClientURL(), id, lease, t.TempDir())
		cfg.Log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelError}))
		return node.Start(context.Background(), cfg)
	}
	beat := func(id string) {
		data, _ := json.Marshal(messages.NodeHeartbeat{Node: id, Boot: "feedfacefeedface", LeaseMS: 400})
		require.NoError(t, nc.Publish("kvactors._node."+id+".heartbeat", data))
	}

	var asked atomic.Int32
	stuck, err := nc.Subscribe("kvactors._node.stuck.identity", func(*nats.Msg) { asked.Add(1) })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	stopBeating := beatEvery(t, nc, "stuck", "feedfacefeedface", lease/4) // its heartbeat loop runs
	_, err = start("stuck")
	stopBeating()
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), "served by boot feedfacefeedface (heard beating)")
	require.Contains(t, err.Error(), "did not answer 3 probes")
	require.EqualValues(t, 3, asked.Load(), "asked three times")
	require.NotContains(t, logs.String(), "another kvactors process", "what a start hears decides the start; it is no conflict")
	require.NoError(t, stuck.Unsubscribe())

	// A stuck holder is not passed over when another process starting at
	// the same moment answers (as starting, with a higher boot: it yields).
	_, err = nc.Subscribe("kvactors._node.pair.identity", func(*nats.Msg) {})
	require.NoError(t, err)
	answerStarting(t, nc, "pair", "ffffffffffffffff")
	stopBeating = beatEvery(t, nc, "pair", "feedfacefeedface", lease/4)
	_, err = start("pair")
	stopBeating()
	require.ErrorIs(t, err, node.ErrNodeIDInUse, "started beside a process that beats with the id")
	require.Contains(t, err.Error(), "served by boot feedfacefeedface (heard beating)")

	// One that beat before and is gone now holds nothing.
	_, err = nc.Subscribe("kvactors._node.gone.identity", func(*nats.Msg) { beat("gone") })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	began := time.Now()
	n, err := start("gone")
	require.NoError(t, err, "no heartbeat for a lease: the silent holder is taken for gone")
	require.GreaterOrEqual(t, time.Since(began), lease, "it waited a lease for a heartbeat")
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	readyWithoutConflict(t, n.Ready, "the silent holder taken for gone")
	beat("gone") // it comes back
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if err := n.Ready(); err == nil || !strings.Contains(err.Error(), "feedfacefeedface") {
			return fmt.Errorf("ready: %v", err)
		}
		return nil
	})

	_, err = nc.Subscribe("kvactors._node.strange.identity", func(m *nats.Msg) { _ = m.Respond([]byte("hello?")) })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	_, err = start("strange")
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), "not as a node")
}

// /readyz fails for the longer of the two leases after another boot is
// heard: a process with a longer lease beats less often than this one's
// lease.
func TestAConflictLastsTheOtherBootsLongerLease(t *testing.T) {
	t.Parallel()
	const lease = 200 * time.Millisecond
	var offset atomic.Int64 // the node's clock runs ahead of the wall clock by this
	e := startNode(t, func(c *node.Config) { c.NodeID, c.Lease = "long", lease },
		node.WithClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }))
	data, _ := json.Marshal(messages.NodeHeartbeat{Node: "long", Boot: "feedfacefeedface", LeaseMS: 60_000})
	require.NoError(t, e.nc.Publish("kvactors._node.long.heartbeat", data))
	// Ready checks the fence (real clock, lease/2 = 100 ms without a round
	// trip) before the conflict, so a starved pinger can make it report
	// "fenced" for a moment: wait for the conflict itself, not any error.
	conflict := func(want bool) func() error {
		return func() error {
			err := e.node.Ready()
			if got := err != nil && strings.Contains(err.Error(), "also in use"); got != want {
				return fmt.Errorf("ready: %v; want the conflict reported: %v", err, want)
			}
			if !want && err != nil {
				return fmt.Errorf("ready: %v", err)
			}
			return nil
		}
	}
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, conflict(true))
	// Ten seconds on, fifty of this node's leases: still within the other
	// boot's 60 s lease.
	offset.Store(int64(50 * lease))
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, conflict(true))
	offset.Store(int64(61 * time.Second)) // the other boot's lease is over
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, conflict(false))
}

// Each other boot heard is logged once a lease, not once for whichever was
// heard last: two boots beating in turn log one error each.
func TestEachOtherBootIsLoggedOnceALease(t *testing.T) {
	t.Parallel()
	var logs testkit.SyncBuffer
	e := startNode(t, func(c *node.Config) {
		c.NodeID, c.Lease = "many", time.Minute
		c.Log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelError}))
	})
	boots := []string{"aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"}
	for i := range 6 {
		data, _ := json.Marshal(messages.NodeHeartbeat{Node: "many", Boot: boots[i%2]})
		require.NoError(t, e.nc.Publish("kvactors._node.many.heartbeat", data))
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			if got := e.counter("kvactors_node_id_conflicts_total", ""); got != float64(i+1) {
				return fmt.Errorf("conflicts %v, want %d", got, i+1)
			}
			return nil
		})
	}
	for _, b := range boots {
		require.Equal(t, 1, strings.Count(logs.String(), "other_boot="+b), "%s logged once:\n%s", b, logs.String())
	}
}

// answerStarting answers id's identity probe as a process starting with
// boot does.
func answerStarting(t *testing.T, nc *nats.Conn, id, boot string) {
	t.Helper()
	_, err := nc.Subscribe("kvactors._node."+id+".identity", func(m *nats.Msg) {
		data, _ := json.Marshal(messages.Hello{Node: id, Boot: boot, LeaseMS: 400, Starting: true})
		_ = m.Respond(data)
	})
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
}

// beatEvery publishes id's heartbeats under boot every period, as a
// running process's heartbeat loop does, until the returned stop.
func beatEvery(t *testing.T, nc *nats.Conn, id, boot string, period time.Duration) (stop func()) {
	data, _ := json.Marshal(messages.NodeHeartbeat{Node: id, Boot: boot, LeaseMS: 400})
	return testkit.Every(t, period, func() { _ = nc.Publish("kvactors._node."+id+".heartbeat", data) })
}

// A start waiting out a silent subscriber's probes and lease ends when its
// context does (serve's SIGTERM), not when the wait would.
func TestAStartWaitingOnASilentSubscriberEndsWithItsContext(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	asked := make(chan struct{}, 16)
	_, err := nc.Subscribe("kvactors._node.wait.identity", func(*nats.Msg) { asked <- struct{}{} })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := node.Start(ctx, idConfig(s.ClientURL(), "wait", time.Second, t.TempDir()))
		done <- err
	}()
	for range 3 { // the third unanswered: the lease's wait begins
		testkit.Recv(t, asked, 5*time.Second, "a probe")
	}
	cancel()
	err = testkit.Recv(t, done, 10*time.Second, "the start's end")
	require.ErrorIs(t, err, context.Canceled)
}
