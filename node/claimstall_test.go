package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// stalledEngine is an engine on the same intake shard as other (an id
// found by trying), and an inbox that gathers the replies to its requests,
// each on _INBOX.<its id>.stalled.<tag> (lookupcost_test sends another
// engine's there too).
func stalledEngine(t *testing.T, e *env, other string) (te *testEngine, ask func(verb, tag string, body any),
	replies <-chan *nats.Msg) {
	t.Helper()
	id := "b1"
	for i := 2; e.node.IntakeShard(id) != e.node.IntakeShard(other); i++ {
		id = fmt.Sprintf("b%d", i)
	}
	te = e.newEngine(id, defaultOpts())
	ch := make(chan *nats.Msg, 16)
	sub, err := e.nc.ChanSubscribe("_INBOX.*.stalled.*", ch)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	ask = func(verb, tag string, body any) {
		t.Helper()
		data, err := json.Marshal(body)
		require.NoError(t, err)
		require.NoError(t, e.nc.PublishRequest("kvactors."+id+"."+verb, "_INBOX."+id+".stalled."+tag, data))
		require.NoError(t, e.nc.Flush())
	}
	return te, ask, ch
}

// On a cluster a register's claim waits on JetStream, for up to a lease in
// a stall (a KV leader election). It waits off the intake's shard worker
// (PROTOCOL.md "Ownership": every message of an engine handled in the order
// it was sent, per engine): engine a, on the same shard as b whose claim
// is stalled, has its batch applied and its heartbeat and status answered
// while b's claim is still held; b's own later messages (a batch, a second
// register, a heartbeat, a status) wait behind its register and are handled
// after it, in the order b sent them, once the claim ends.
func TestClusterStalledClaimHoldsUpOnlyItsEngine(t *testing.T) {
	t.Parallel()
	// The lease bounds the stall: a's answers must come within it.
	e := startNode(t, func(c *node.Config) { c.Cluster, c.Lease = true, 4*time.Second })
	a := e.newEngine("a1", defaultOpts())
	a.register()
	b, ask, replies := stalledEngine(t, e, a.id)
	entered, left, release := e.node.StallClaim(b.id)
	defer release()

	ask("register", "reg1", b.spec)
	testkit.Recv(t, entered, 5*time.Second, "b's claim stalled")
	b.send(added("r", 8))
	ask("register", "reg2", b.spec) // identical: a no-op once b is registered
	ask("heartbeat", "hb", messages.HeartbeatRequest{Epoch: b.epoch, Seq: b.seq})
	ask("status", "st", map[string]any{})

	a.send(added("q", 8))
	var hb messages.HeartbeatReply
	require.NoError(t, json.Unmarshal(a.request("heartbeat", messages.HeartbeatRequest{Epoch: a.epoch, Seq: a.seq}), &hb))
	require.Empty(t, hb.Error)
	require.Equal(t, uint64(1), hb.Applied, "a's batch applied")
	require.Equal(t, uint64(1), a.sync().Seq)
	select {
	case <-left:
		t.Fatal("a was answered only once b's stalled claim had ended")
	default:
	}
	select {
	case m := <-replies:
		t.Fatalf("b answered on %s before its claim ended", m.Subject)
	default:
	}

	release()
	testkit.Recv(t, left, 5*time.Second, "b's claim let go")
	var got []string
	for range 4 {
		m := testkit.Recv(t, replies, 5*time.Second, "b's replies")
		tag := m.Subject[strings.LastIndex(m.Subject, ".")+1:]
		got = append(got, tag)
		switch tag {
		case "reg1", "reg2":
			var r messages.RegisterReply
			require.NoError(t, json.Unmarshal(m.Data, &r))
			require.True(t, r.OK, "%s: %s", m.Subject, m.Data)
		case "hb":
			var r messages.HeartbeatReply
			require.NoError(t, json.Unmarshal(m.Data, &r))
			require.Empty(t, r.Error)
			require.Equal(t, uint64(1), r.Applied, "b's batch applied after its register, before its heartbeat")
		case "st":
			var st node.StatusReply
			require.NoError(t, json.Unmarshal(m.Data, &st))
			require.Empty(t, st.Error)
			require.Equal(t, uint64(1), st.Seq)
		}
	}
	require.Equal(t, []string{"reg1", "reg2", "hb", "st"}, got, "b's messages handled in the order b sent them")
	require.Equal(t, 2.0, e.counter("kvactors_cluster_ownership_decisions_total", "claim"),
		"one claim each for a and b: b's second register serves on its first one's")
	require.ElementsMatch(t, []string{a.id, b.id}, e.node.Engines())
}

// A node closed while a register's claim is stalled: the intake halts the
// claim and waits for it, so no goroutine outlives Close and Close does not
// wait out the claim's lease; the register is not claimed (its engine
// registers elsewhere) and its bytes leave the intake budget.
func TestClusterCloseDuringAStalledClaim(t *testing.T) {
	t.Parallel()
	e := startNode(t, func(c *node.Config) { c.Cluster, c.Lease = true, 30*time.Second })
	a := e.newEngine("a1", defaultOpts())
	a.register()
	b, ask, _ := stalledEngine(t, e, a.id)
	entered, left, release := e.node.StallClaim(b.id)
	defer release()
	ask("register", "reg1", b.spec)
	testkit.Recv(t, entered, 5*time.Second, "b's claim stalled")
	b.send(added("r", 8)) // parked behind the register

	closed := make(chan error, 1)
	go func() { closed <- e.node.Close(context.Background()) }()
	testkit.Recv(t, left, 10*time.Second, "the stalled claim halted, well within its 30 s lease")
	require.NoError(t, testkit.Recv(t, closed, 10*time.Second, "Close"))
	require.Equal(t, []string{}, e.node.Engines())
	require.Equal(t, 1.0, e.counter("kvactors_cluster_ownership_decisions_total", "claim"), "a's claim only")
	require.Zero(t, e.node.IntakePending(), "the register's and the parked batch's bytes released")
	bytes, held := e.node.IntakeBuckets()
	require.Zero(t, bytes, "released to their engine's bucket")
	require.Zero(t, held, "released to their engine's bucket")
}

// An engine parked behind its stalled claim holds at most half the intake
// budget: past that its messages are dropped as on a full intake (a batch
// counted as an overflow drop, a request counted as an overflow rejection,
// unanswered: on a cluster only the engine's node answers a request it
// dropped unread, and the claim has not made this node it yet), and the
// other engines keep the rest of the budget.
func TestClusterStalledClaimParksAtMostHalfTheBudget(t *testing.T) {
	t.Parallel()
	// 32 MiB (4 × the embedded server's max payload): 16 MiB for the
	// intake's queues, so b may park 8 MiB. The lease bounds the stall
	// (the claim's deadline): 30 s, so the steps below, 9 MiB sent and
	// counted, fit in it however loaded the machine (with 4 s a -race run
	// beside another suite outlasted it: the claim gave up, no reply).
	e := startNode(t, func(c *node.Config) { c.Cluster, c.Lease, c.MaxPendingBytes = true, 30*time.Second, 32<<20 })
	a := e.newEngine("a1", defaultOpts())
	a.register()
	b, ask, replies := stalledEngine(t, e, a.id)
	entered, left, release := e.node.StallClaim(b.id)
	defer release()
	ask("register", "reg1", b.spec)
	testkit.Recv(t, entered, 5*time.Second, "b's claim stalled")
	pad := strings.Repeat("x", 3<<20)
	for seq := 1; seq <= 3; seq++ { // the third passes 8 MiB, and so does a lookup as large
		b.sendRaw(map[string]any{"epoch": b.epoch, "seq": seq, "events": []any{}, "pad": pad})
	}
	ask("lookup", "lk", map[string]any{"hashes": []string{}, "pad": pad})
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if got := e.counter("kvactors_events_rejected_total", "overflow"); got != 1 {
			return fmt.Errorf("%v requests dropped as overflow, want 1", got)
		}
		return nil
	})
	require.Equal(t, 1.0, e.counter("kvactors_dropped_batches_total", "overflow"))

	a.send(added("q", 8))
	require.Equal(t, uint64(1), a.sync().Seq, "a served meanwhile")
	select {
	case <-left:
		t.Fatal("b's claim ended before its release: its deadline (the lease) ran out")
	default:
	}
	release()
	m := testkit.Recv(t, replies, 5*time.Second, "b's register reply")
	require.True(t, strings.HasSuffix(m.Subject, ".reg1"), "the lookup dropped unread is not answered: %s %s", m.Subject, m.Data)
	require.Contains(t, string(m.Data), `"ok":true`)
	// Every byte comes back, the dropped messages' too, each to the bucket
	// it counts in.
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if bytes, held := e.node.IntakeBuckets(); e.node.IntakePending() != 0 || bytes != 0 || held != 0 {
			return fmt.Errorf("intake holds %d bytes, its buckets %d, %d of them not 0", e.node.IntakePending(), bytes, held)
		}
		return nil
	})
}
