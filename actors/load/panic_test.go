package load_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
)

// panicsOnStart is a tracer whose Start panics: a failure in the load
// actor's first turn, before its copy is submitted.
type panicsOnStart struct{ noop.Tracer }

func (panicsOnStart) Start(context.Context, string, ...trace.SpanStartOption) (context.Context, trace.Span) {
	panic("tracer failure injected")
}

// panicsOnInc is a counter whose Inc panics (the unexpected-message
// counter): a failure in a turn while the copy is out.
type panicsOnInc struct{ prometheus.Counter }

func (panicsOnInc) Inc() { panic("counter failure injected") }

// A load actor whose turn panics is resumed and ends its load, never
// restarted: protoactor's default restart ran the producer again, whose
// fresh instance submitted the copy a second time (keys the first copy had
// unpinned) and called Done again. Whichever turn fails, the load submits
// at most once, answers once, calls Done once and stops; keys pinned for a
// copy never submitted are unpinned (Abort).
func TestAPanickingLoadActorEndsItsLoadOnce(t *testing.T) {
	for _, tc := range []struct {
		name    string
		set     func(r *rig)
		submits int    // copies submitted
		stray   bool   // a stray message (Unexpected) before JobDone
		wantErr string // "": answered ok
		aborted bool
	}{
		{name: "after its reply", submits: 1,
			set: func(r *rig) { r.deps.Done = func() { r.done.Add(1); panic("Done failure injected") } }},
		{name: "before its submit", submits: 0, wantErr: "copy failed: load actor failed: tracer failure injected", aborted: true,
			set: func(r *rig) { r.deps.Tracer = panicsOnStart{} }},
		{name: "while its copy is out", submits: 1, stray: true,
			set: func(r *rig) { r.deps.Unexpected = panicsOnInc{} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			tc.set(r)
			st := &abortStore{}
			j := job(2)
			j.Store = st
			stopped := r.start(j)
			if tc.submits == 1 {
				sub := testkit.Recv(t, r.submits, wait, "submit")
				if tc.stray {
					r.system.Root.Send(sub.Owner, "stray")
				}
				r.system.Root.Send(sub.Owner, &transfer.JobDone{ID: sub.ID})
			}
			rep := r.reply()
			require.Equal(t, tc.wantErr == "", rep.OK, rep.Error)
			require.Equal(t, tc.wantErr, rep.Error)
			testkit.Recv(t, stopped, wait, "the load actor stops")
			require.Empty(t, r.submits, "a copy submitted again")
			require.EqualValues(t, 1, r.done.Load(), "Done calls")
			require.EqualValues(t, 1, r.loads("ok")+r.loads("error"))
			st.mu.Lock()
			defer st.mu.Unlock()
			if tc.aborted {
				require.Len(t, st.aborted, len(j.Chunks), "the pinned keys are unpinned")
			} else {
				require.Empty(t, st.aborted)
			}
		})
	}
}
