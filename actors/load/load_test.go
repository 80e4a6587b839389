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

func (nopStore) Copy(backend.Direction, []sched.JobChunk) error { return nil }
func (nopStore) Abort(backend.Direction, []sched.JobChunk)      {}

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
				Outbox: actors.NewOutbox(nc, "kvactors", log), Metrics: metrics.Discard(),
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
