package node_test

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
	s := testkit.NATSServer(t)
	const lease = 400 * time.Millisecond
	shared := func(id string) func(*node.Config) {
		return func(c *node.Config) { c.NATSURL, c.NodeID, c.Lease = s.ClientURL(), id, lease }
	}
	a := startNode(t, shared("dup"))

	_, err := node.Start(context.Background(), idConfig(s.ClientURL(), "dup", lease, t.TempDir()))
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), a.node.Boot(), "the refusal names the running boot")
	require.NoError(t, a.node.Ready(), "a refused start is no conflict for the running node")
	require.Zero(t, a.counter("kvactors_node_id_conflicts_total", ""))

	other := startNode(t, shared("other")) // another id on the same NATS starts
	require.NoError(t, other.node.Ready())

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
	require.NoError(t, other.node.Ready(), "another id hears nothing of it")

	require.NoError(t, b.node.Close(context.Background()))
	testkit.Eventually(t, 5*lease, 10*time.Millisecond, a.node.Ready) // a lease after the last heartbeat

	require.NoError(t, a.node.Close(context.Background()))
	c := startNode(t, shared("dup")) // the id is free again: no wait
	require.NoError(t, c.node.Ready())
}

func idConfig(url, id string, lease time.Duration, dir string) node.Config {
	return node.Config{NATSURL: url, NodeID: id, Lease: lease, HTTPAddr: "off", ShmDir: dir, PoolBytes: 1 << 20}
}

// Two processes starting with one id at the same moment: each answers the
// other's probe before its own probe ends, so exactly one of them starts,
// whatever the interleaving (both seeing each other, the lower boot goes
// on; one seeing the other, the other is past its probe or yields).
func TestOfTwoStartingWithOneNodeIDExactlyOneStarts(t *testing.T) {
	s := testkit.NATSServer(t)
	for round := range 8 {
		var wg sync.WaitGroup
		nodes := make([]*node.Node, 2)
		errs := make([]error, 2)
		for i := range nodes {
			wg.Go(func() {
				nodes[i], errs[i] = node.Start(context.Background(), idConfig(s.ClientURL(), "twin", 2*time.Second, t.TempDir()))
			})
		}
		wg.Wait()
		started := 0
		for i, n := range nodes {
			if errs[i] == nil {
				started++
				require.NoError(t, n.Close(context.Background()))
				continue
			}
			require.ErrorIs(t, errs[i], node.ErrNodeIDInUse, "round %d", round)
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
	s, nc := testkit.NATS(t)
	const lease = 400 * time.Millisecond
	starting := func(id, boot string) *nats.Subscription {
		sub, err := nc.Subscribe("kvactors._node."+id+".identity", func(m *nats.Msg) {
			data, _ := json.Marshal(messages.Hello{Node: id, Boot: boot, LeaseMS: 400, Starting: true})
			_ = m.Respond(data)
		})
		require.NoError(t, err)
		require.NoError(t, nc.Flush())
		return sub
	}
	starting("low", "0000000000000000")
	_, err := node.Start(context.Background(), idConfig(s.ClientURL(), "low", lease, t.TempDir()))
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), "0000000000000000 is starting with it")

	starting("high", "ffffffffffffffff")
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
func TestASilentOrStrangeSubscriberOnTheNodeID(t *testing.T) {
	s, nc := testkit.NATS(t)
	const lease = 400 * time.Millisecond
	start := func(id string) (*node.Node, error) {
		return node.Start(context.Background(), idConfig(s.ClientURL(), id, lease, t.TempDir()))
	}
	beat := func(id string) {
		data, _ := json.Marshal(messages.NodeHeartbeat{Node: id, Boot: "feedfacefeedface", LeaseMS: 400})
		require.NoError(t, nc.Publish("kvactors._node."+id+".heartbeat", data))
	}

	var asked atomic.Int32
	stuck, err := nc.Subscribe("kvactors._node.stuck.identity", func(*nats.Msg) { asked.Add(1); beat("stuck") })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	_, err = start("stuck")
	require.ErrorIs(t, err, node.ErrNodeIDInUse)
	require.Contains(t, err.Error(), "boot feedfacefeedface beats with it")
	require.Contains(t, err.Error(), "did not answer 3 probes")
	require.EqualValues(t, 3, asked.Load(), "asked three times")
	require.NoError(t, stuck.Unsubscribe())

	_, err = nc.Subscribe("kvactors._node.gone.identity", func(*nats.Msg) {})
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	began := time.Now()
	n, err := start("gone")
	require.NoError(t, err, "no heartbeat for a lease: the silent holder is taken for gone")
	require.GreaterOrEqual(t, time.Since(began), lease, "it waited a lease for a heartbeat")
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	require.NoError(t, n.Ready())
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
	const lease = 200 * time.Millisecond
	e := startNode(t, func(c *node.Config) { c.NodeID, c.Lease = "long", lease })
	data, _ := json.Marshal(messages.NodeHeartbeat{Node: "long", Boot: "feedfacefeedface", LeaseMS: 60_000})
	heard := time.Now()
	require.NoError(t, e.nc.Publish("kvactors._node.long.heartbeat", data))
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if e.node.Ready() == nil {
			return fmt.Errorf("not heard yet")
		}
		return nil
	})
	// Past this node's own lease, still failing: wait on the clock itself.
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if time.Since(heard) < 3*lease {
			return fmt.Errorf("not yet three of this node's leases")
		}
		return nil
	})
	require.ErrorContains(t, e.node.Ready(), "also in use", "within the other boot's 60 s lease")
}

// Each other boot heard is logged once a lease, not once for whichever was
// heard last: two boots beating in turn log one error each.
func TestEachOtherBootIsLoggedOnceALease(t *testing.T) {
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
