package transfer

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/sched"
)

// abortsTold is a Store that tells which jobs' pool side was aborted, each
// by its number of chunks (the test gives each job a count of its own).
type abortsTold struct{ aborted []sched.JobID }

func (s *abortsTold) Copy(backend.Direction, []sched.JobChunk, func() error) error { return nil }
func (s *abortsTold) Abort(_ backend.Direction, c []sched.JobChunk) {
	s.aborted = append(s.aborted, sched.JobID(len(c)))
}

// A queued job with no owner (its submitter's bug) is nobody's: a drain
// compares owners without panicking, takes only the owner's own jobs, and
// leaves the rest of the queue whole. A panic there, halfway through the
// removal that compacts the queue in place, left one job twice and lost
// the drained one's abort.
func TestADrainPassesOverAnOwnerlessJob(t *testing.T) {
	q := NewQueue(Config{Workers: 1}, nil)
	x := actor.NewPID("local", "x")
	y := actor.NewPID("local", "y")
	st := &abortsTold{}
	chunks := func(n int) []sched.JobChunk { return make([]sched.JobChunk, n) }
	a := &Submit{Owner: x, ID: 1, Store: st, Chunks: chunks(1)}
	k := &Submit{Owner: y, ID: 2, Store: st, Chunks: chunks(2)}
	n := &Submit{Owner: nil, ID: 3, Store: st, Chunks: chunks(3)}
	for _, s := range []*Submit{a, k, n} {
		q.Submit(s)
	}
	ran := false
	q.DrainThen(x, func() { ran = true }) // no job of x copies: at once
	require.True(t, ran)
	require.Equal(t, []*Submit{k, n}, q.items, "x's job taken, the others kept once each")
	require.Equal(t, []sched.JobID{1}, st.aborted, "x's job aborted")
	require.True(t, sameOwner(nil, nil))
	require.False(t, sameOwner(nil, x))
	require.False(t, sameOwner(x, nil))
	require.True(t, sameOwner(x, actor.NewPID("local", "x")))
}

// A load goes ahead of a queued store, but no more than loadsPastAStore
// loads do: loads coming faster than the copies run would otherwise keep
// the store from ever starting (its request never released, its pending
// room never freed). Loads still keep their order among themselves, and a
// store goes ahead of nothing.
func TestAStoreIsPassedByAtMostLoadsPastAStoreLoads(t *testing.T) {
	q := NewQueue(Config{Workers: 1}, nil)
	var id sched.JobID
	job := func(dir backend.Direction) *Submit {
		id++
		return &Submit{ID: id, Dir: dir, Bytes: 1}
	}
	store := job(backend.DeviceToHost)
	q.Submit(store)
	var order []*Submit
	for range 3 * loadsPastAStore { // two loads submitted per copy that starts
		q.Submit(job(backend.HostToDevice))
		q.Submit(job(backend.HostToDevice))
		s := q.next()
		order = append(order, s)
		q.done(&copyDone{job: s})
		if s == store {
			break
		}
	}
	require.Contains(t, order, store, "the store started")
	require.LessOrEqual(t, slices.Index(order, store), loadsPastAStore, "at most loadsPastAStore loads went first")
	var last sched.JobID
	for _, s := range order {
		if s != store {
			require.Greater(t, s.ID, last, "loads in the order submitted")
			last = s.ID
		}
	}
}

// A cancelled job that stood at the head, too large to start beside the
// copy running, lets the smaller one behind it start at once: an idle
// worker is woken for it, not left waiting until the running copy ends.
func TestCancellingTheHeadWakesAWorkerForTheJobBehind(t *testing.T) {
	q := NewQueue(Config{Workers: 2, MaxInFlightBytes: 10}, nil)
	defer q.close()
	x := actor.NewPID("local", "x")
	running := &Submit{Owner: x, ID: 1, Bytes: 5}
	q.Submit(running)
	require.Same(t, running, q.next())
	big := &Submit{Owner: x, ID: 2, Bytes: 8, Store: &abortsTold{}}
	small := &Submit{Owner: x, ID: 3, Bytes: 2}
	q.Submit(big)
	q.Submit(small)
	started := make(chan *Submit, 1)
	go func() { started <- q.next() }() // waits: the head does not fit
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		q.mu.Lock()
		defer q.mu.Unlock()
		if q.idle != 1 {
			return fmt.Errorf("%d workers waiting", q.idle)
		}
		return nil
	})
	require.Equal(t, []*Submit{big}, q.cancel(x, []sched.JobID{2}))
	require.Same(t, small, testkit.Recv(t, started, 2*time.Second, "the job behind the cancelled head starting"))
}

// The completion list the actor gives back takes the next completions (no
// new list per batch), emptied of what it held; one taken again before
// that is a fresh list, and a huge one is not kept.
func TestACompletionListGivenBackIsReused(t *testing.T) {
	q := NewQueue(Config{Workers: 1}, nil)
	a, b := &Submit{}, &Submit{}
	q.finished = append(q.finished, &a.finished, &b.finished)
	done := q.take()
	require.Len(t, done, 2)
	q.giveBack(done)
	require.Nil(t, done[0], "nothing kept alive through the list")
	q.finished = append(q.finished, &a.finished)
	again := q.take()
	require.Equal(t, []*copyDone{&a.finished}, again)
	require.Same(t, &done[:1][0], &again[0], "the list given back took the completion")

	q.giveBack(make([]*copyDone, 0, spareMost+1))
	require.Nil(t, q.spare, "a list past spareMost is left to the collector")
}
