package load_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/load"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// nopStore is a store whose copies the answering transfer never runs.
type nopStore struct{}

func (nopStore) Copy(backend.Direction, []sched.JobChunk, func() error) error { return nil }
func (nopStore) Abort(backend.Direction, []sched.JobChunk)                    {}

// answeringTransfer answers every Submit with JobDone carrying err.
type answeringTransfer struct {
	err  error
	seen chan *transfer.Submit
}

func (a *answeringTransfer) Receive(c actor.Context) {
	if m, ok := c.Message().(*transfer.Submit); ok {
		a.seen <- m
		c.Send(m.Owner, &transfer.JobDone{ID: m.ID, Err: a.err, Bytes: m.Bytes})
	}
}

// A load submits one host→device copy and answers after it: ok with the
// tokens, or the copy's error; either reply names the node and boot, and
// Done runs once the copy is over (the node unmaps segments only after it).
func TestLoadAnswersAfterTheCopy(t *testing.T) {
	_, nc := testkit.NATS(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	for _, c := range []struct {
		name    string
		copyErr error
		want    messages.LoadReply
	}{
		{"ok", nil, messages.LoadReply{OK: true, LoadedTokens: 8, Node: "n1", Boot: "b1"}},
		{"copy failed", errors.New("dma fault"), messages.LoadReply{Error: "copy failed: dma fault", Node: "n1", Boot: "b1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			seen := make(chan *transfer.Submit, 1)
			xfer := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor {
				return &answeringTransfer{err: c.copyErr, seen: seen}
			}))
			inbox := "_INBOX." + t.Name()
			replies := testkit.Subscribe(t, nc, inbox)
			var done atomic.Int32
			system.Root.Spawn(load.Props(load.Deps{Transfer: xfer,
				Outbox: actors.NewOutbox(nc, "kvactors", log), Metrics: metrics.NewLoad(nil),
				Tracer: noop.NewTracerProvider().Tracer(""), Log: log, Node: "n1", Boot: "b1",
				Done: func() { done.Add(1) }},
				&load.Job{Engine: "e1", Request: "r", Tokens: 8, Store: nopStore{},
					Chunks: []sched.JobChunk{{Key: "k", Blocks: []messages.BlockID{3}}}, Bytes: 64,
					Reply: inbox, Ctx: context.Background()}))
			sub := testkit.Recv(t, seen, 5*time.Second, "the copy")
			require.Equal(t, backend.HostToDevice, sub.Dir)
			var got messages.LoadReply
			require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 5*time.Second, "the reply").Data, &got))
			require.Equal(t, c.want, got)
			testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
				if n := done.Load(); n != 1 {
					return fmt.Errorf("Done ran %d times", n)
				}
				return nil
			})
		})
	}
}

// The load actor is tested black-box: a real NATS server carries its reply,
// a stand-in transfer actor hands its Submit to the test (which answers
// JobDone as the real one would), and a parent actor watches it stop.

const wait = 5 * time.Second

// heldTransfer forwards every Submit to the test.
type heldTransfer struct{ seen chan *transfer.Submit }

func (h *heldTransfer) Receive(c actor.Context) {
	if m, ok := c.Message().(*transfer.Submit); ok {
		h.seen <- m
	}
}

// watcher watches one load actor (spawned from the root context, as the
// node does: its guardian is its supervisor) and reports when it stops.
type watcher struct {
	pid     *actor.PID
	stopped chan struct{}
}

func (w *watcher) Receive(c actor.Context) {
	switch c.Message().(type) {
	case *actor.Started:
		c.Watch(w.pid) // one stopped already: Terminated all the same
	case *actor.Terminated:
		w.stopped <- struct{}{}
	}
}

type rig struct {
	t       *testing.T
	system  *actor.ActorSystem
	replies <-chan *nats.Msg
	submits chan *transfer.Submit
	m       *metrics.Metrics
	deps    load.Deps
	done    atomic.Int32 // calls of deps.Done
}

func newRig(t *testing.T) *rig {
	_, nc := testkit.NATS(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	r := &rig{t: t, system: actor.NewActorSystem(), replies: testkit.Subscribe(t, nc, "_INBOX.test.reply"),
		submits: make(chan *transfer.Submit, 4), m: metrics.New(prometheus.NewRegistry())}
	t.Cleanup(r.system.Shutdown)
	xfer := r.system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &heldTransfer{seen: r.submits} }))
	r.deps = load.Deps{Transfer: xfer, Outbox: actors.NewOutbox(nc, "kvactors", log), Metrics: r.m.Load,
		Unexpected: r.m.Unexpected.WithLabelValues(actors.KindLoad),
		Tracer:     noop.NewTracerProvider().Tracer(""), Log: log, Node: "n1", Boot: "b1",
		Done: func() { r.done.Add(1) }}
	return r
}

// start runs one load of job and returns a channel closed when it stops.
func (r *rig) start(job *load.Job) <-chan struct{} {
	w := &watcher{pid: r.system.Root.Spawn(load.Props(r.deps, job)), stopped: make(chan struct{}, 1)}
	r.system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return w }))
	return w.stopped
}

func (r *rig) reply() messages.LoadReply {
	var rep messages.LoadReply
	msg := testkit.Recv(r.t, r.replies, wait, "load reply")
	require.NoError(r.t, json.Unmarshal(msg.Data, &rep))
	return rep
}

func (r *rig) loads(result string) float64 {
	return testutil.ToFloat64(r.m.Loads.WithLabelValues(result))
}

func job(chunks int) *load.Job {
	j := &load.Job{Engine: "e", Request: "r", Tokens: 16 * chunks, Store: nopStore{}, Reply: "_INBOX.test.reply",
		Ctx: context.Background()}
	for i := range chunks {
		j.Chunks = append(j.Chunks, sched.JobChunk{Index: messages.ChunkIndex(i), Key: messages.Key(rune('a' + i)),
			Blocks: []messages.BlockID{messages.BlockID(i + 1)}})
		j.Bytes += 64
	}
	return j
}

// TestLoadCountsAndStops: whatever the copy's end (ok, failed, or cancelled
// because the transfer actor dropped it), the load is counted by result,
// answers once (a cancelled copy is an error, never ok), calls Done once
// and stops. load_test.go checks the replies' content.
func TestLoadCountsAndStops(t *testing.T) {
	for _, tc := range []struct {
		name    string
		done    transfer.JobDone
		result  string
		wantErr string
	}{
		{"ok", transfer.JobDone{}, "ok", ""},
		{"failed", transfer.JobDone{Err: errors.New("dma fault")}, "error", "copy failed: dma fault"},
		{"cancelled", transfer.JobDone{Cancelled: true}, "error", "copy failed: load cancelled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			j := job(2)
			stopped := r.start(j)
			sub := testkit.Recv(t, r.submits, wait, "submit")
			require.Equal(t, j.Chunks, sub.Chunks)
			tc.done.ID = sub.ID
			r.system.Root.Send(sub.Owner, &tc.done)
			rep := r.reply()
			require.Equal(t, tc.wantErr == "", rep.OK)
			require.Equal(t, tc.wantErr, rep.Error)
			testkit.Recv(t, stopped, wait, "the load actor stops")
			require.EqualValues(t, 1, r.done.Load())
			require.EqualValues(t, 1, r.loads(tc.result))
			require.EqualValues(t, 1, r.loads("ok")+r.loads("error"))
		})
	}
}

// TestLoadNothingToCopy: a load whose every target block is null submits no
// copy and answers ok at once.
func TestLoadNothingToCopy(t *testing.T) {
	r := newRig(t)
	j := job(0)
	j.Tokens = 48
	stopped := r.start(j)
	require.Equal(t, messages.LoadReply{OK: true, LoadedTokens: 48, Node: "n1", Boot: "b1"}, r.reply())
	testkit.Recv(t, stopped, wait, "the load actor stops")
	select {
	case sub := <-r.submits:
		t.Fatalf("a copy was submitted: %+v", sub)
	default:
	}
	require.EqualValues(t, 1, r.done.Load())
}

// TestLoadUnexpectedMessage: a stray message is counted, not acted on; the
// load still completes normally.
func TestLoadUnexpectedMessage(t *testing.T) {
	r := newRig(t)
	stopped := r.start(job(1))
	sub := testkit.Recv(t, r.submits, wait, "submit")
	r.system.Root.Send(sub.Owner, "stray")
	testkit.Eventually(t, wait, 5*time.Millisecond, func() error {
		if n := testutil.ToFloat64(r.m.Unexpected.WithLabelValues(actors.KindLoad)); n != 1 {
			return fmt.Errorf("unexpected messages counted: %v", n)
		}
		return nil
	})
	r.system.Root.Send(sub.Owner, &transfer.JobDone{ID: sub.ID})
	require.True(t, r.reply().OK)
	testkit.Recv(t, stopped, wait, "the load actor stops")
}
