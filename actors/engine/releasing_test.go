package engine_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// finishing is engine e1 (closing closed when it stops) with request r
// finished and its one store job j in flight: r's final release waits for
// j's JobDone, which the test sends.
type finishing struct {
	system *actor.ActorSystem
	pid    *actor.PID
	m      *metrics.Metrics
	j      *transfer.Submit
}

func startFinishing(t *testing.T, nc *nats.Conn, closed chan struct{}) finishing {
	t.Helper()
	return startFinishingDeps(t, nc, closed, nil)
}

// startFinishingDeps is startFinishing with the engine's deps set by
// editEngine (nil: none).
func startFinishingDeps(t *testing.T, nc *nats.Conn, closed chan struct{}, editEngine func(*engine.Deps)) finishing {
	t.Helper()
	jobs := make(chan *transfer.Submit, 16)
	system, pid, m, _ := startEngineDeps(t, nc, closed, func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		d.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).
			Engine("e1", lay, testkit.NopDevice{})
		d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &submits{ch: jobs} }))
	}, editEngine)
	sendBatch(system, pid, 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "r's store job")
	sendBatch(system, pid, 2, finished("r"))
	return finishing{system: system, pid: pid, m: m, j: j}
}

// hold posts batch seq (no events) whose Done waits until the returned func
// is called: the engine actor is held inside that turn, and what is posted
// to it meanwhile queues, system messages (a child's Terminated) ahead of
// user messages (a request's Done).
func (f finishing) hold(t *testing.T, seq uint64) (letGo func()) {
	t.Helper()
	holding, gate := make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	letGo = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(letGo) // a failed test leaves the engine free to stop
	go f.system.Root.Send(f.pid, &engine.Batch{Ctx: context.Background(),
		Batch: messages.EventBatch{Epoch: "a", Seq: seq}, Done: actors.SignalFunc(func() {
			holding <- struct{}{}
			<-gate
		})})
	testkit.Recv(t, holding, 5*time.Second, "the engine held in a turn")
	return letGo
}

// complete ends r's job: r publishes its final release (its releasing flag
// up) and posts its Done to the engine, which is held and does not take it.
// r is idle, so the JobDone runs on this goroutine.
func (f finishing) complete(t *testing.T, released <-chan *nats.Msg) {
	t.Helper()
	require.NoError(t, f.j.Store.Copy(f.j.Dir, f.j.Chunks, nil))
	f.system.Root.Send(f.j.Owner, &transfer.JobDone{ID: f.j.ID})
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r's final release").Data, &rel))
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonFinished}, rel)
}

// A request actor that stops after its final release went out, its Done not
// yet handled (Terminated, a system message, is taken first), is not
// released again as aborted: the engine may already have reused the id, and
// a second release would free the new request's blocks.
func TestARequestThatStopsAfterItsFinalReleaseIsNotReleasedAgain(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	replies := testkit.Subscribe(t, nc, "_INBOX.test.heartbeat")
	f := startFinishing(t, nc, make(chan struct{}))
	letGo := f.hold(t, 3)
	f.complete(t, released)
	// r is idle: its stop runs here, so its Terminated is queued when Stop
	// returns, behind nothing (the held engine runs system messages first).
	f.system.Root.Stop(f.j.Owner)
	letGo()

	// The reply counts the epoch's releases under the lock they are
	// published under, after every message queued before it.
	f.system.Root.Send(f.pid, &engine.Heartbeat{Epoch: "a", Seq: 3, Reply: "_INBOX.test.heartbeat"})
	var reply messages.HeartbeatReply
	require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 5*time.Second, "the heartbeat reply").Data, &reply))
	require.Equal(t, 1.0, testutilValue(f.m), "the Terminated was taken before the Done (r counted as failed)")
	require.Equal(t, uint64(1), reply.Released, "r released once")
	select { // published before the reply, on the same connection: here by now
	case m := <-released:
		t.Fatalf("a second release: %s", m.Data)
	default:
	}
}

// A retire that reaches the engine after a request's final release went
// out, its Done not yet handled, does not count the request as reset
// (unregister reports the count as released engine_gone): no release of
// that reason comes, and r is released once.
func TestARetireAfterAFinalReleaseDoesNotCountTheRequest(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	f := startFinishing(t, nc, closed)
	letGo := f.hold(t, 3)
	count := make(chan int, 1)
	f.system.Root.Send(f.pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: count}) // ahead of r's Done
	f.complete(t, released)
	letGo()

	require.Zero(t, testkit.Recv(t, count, 5*time.Second, "the retire's count"), "r counted as reset")
	select { // closed, not sent on
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the retired engine did not stop")
	}
	require.NoError(t, nc.Flush()) // a release published before the stop is in released now
	select {
	case m := <-released:
		t.Fatalf("a second release: %s", m.Data)
	default:
	}
}

// --max-requests bounds the requests live for the engine: one whose final
// release went out is not, though its Done is not handled yet. An engine at
// the limit that frees a slot on the release and adds a request at once
// (its batch ahead of the Done in the engine's mailbox) has the added
// taken, not refused "limit".
func TestAnAddedRightAfterAReleaseAtTheLimitIsTaken(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	f := startFinishingDeps(t, nc, make(chan struct{}), func(d *engine.Deps) { d.MaxRequests = 1 })
	letGo := f.hold(t, 3)
	sendBatch(f.system, f.pid, 4, added("r2")) // queued ahead of r's Done
	f.complete(t, released)
	letGo()

	st := statusOf(t, f.system, f.pid)
	require.Len(t, st.Requests, 1)
	require.Equal(t, "r2", st.Requests[0].Request, "r2 is live")
	require.Zero(t, testutil.ToFloat64(f.m.Events.Rejected.WithLabelValues(messages.RejectLimit)), "refused: limit")

	// The limit still holds: r2 is live, so a third request is refused.
	sendBatch(f.system, f.pid, 5, added("r3"))
	statusOf(t, f.system, f.pid)
	require.Equal(t, 1.0, testutil.ToFloat64(f.m.Events.Rejected.WithLabelValues(messages.RejectLimit)))
}

// An engine that reuses a request's id as soon as it reads the request's
// release (its added queued ahead of the old request's Done) gets a new
// request: the added is not routed to the finished one, which would reject
// it as released and leave the engine's request untracked.
func TestAnAddedOfTheIDRightAfterItsReleaseIsANewRequest(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	f := startFinishing(t, nc, make(chan struct{}))
	letGo := f.hold(t, 3)
	sendBatch(f.system, f.pid, 4, added("r")) // queued ahead of r's Done
	f.complete(t, released)
	letGo()

	st := statusOf(t, f.system, f.pid)
	require.Len(t, st.Requests, 1, "the engine's new request r is live")
	require.Equal(t, "r", st.Requests[0].Request)
	require.NotEqual(t, sched.Done, st.Requests[0].Phase, "the new r, not the released one")
	require.Zero(t, testutil.ToFloat64(f.m.Events.Rejected.WithLabelValues(messages.RejectReleased)),
		"the added rejected: released")
}
