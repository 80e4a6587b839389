package transfer

import (
	"fmt"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/internal/testkit"
)

// lastPerOwner marks every completion but each owner's last in the batch
// (JobDone.More): an owner whose last completion carried More would never
// take the decision its completions call for, so this is checked on both
// paths (a scan up to 8 completions, a map past that) against a plain
// reference, with owners interleaved.
func TestLastPerOwnerMarksAllButEachOwnersLast(t *testing.T) {
	owners := []*actor.PID{actor.NewPID("l", "a"), actor.NewPID("l", "b"), actor.NewPID("l", "c")}
	for _, n := range []int{1, 2, 5, 8, 9, 13, 40} {
		var done []*copyDone
		for i := range n {
			done = append(done, &copyDone{job: &Submit{Owner: owners[(i*7+i/3)%len(owners)]}})
		}
		got := lastPerOwner(nil, done)
		for i, d := range done {
			want := false
			for _, e := range done[i+1:] {
				if e.job.Owner == d.job.Owner {
					want = true
				}
			}
			if got[i] != want {
				t.Fatalf("%d completions: More[%d] = %v, want %v", n, i, got[i], want)
			}
		}
		last := map[*actor.PID]int{}
		for i, d := range done {
			last[d.job.Owner] = i
		}
		for o, i := range last {
			if got[i] {
				t.Fatalf("%d completions: owner %s's last completion carries More", n, fmt.Sprint(o.Id))
			}
		}
	}
}

// Submit reports waking a waiting worker, and only that: with every worker
// busy, submitting wakes no one.
func TestSubmitReportsAWokenWorker(t *testing.T) {
	q := NewQueue(Config{Workers: 1}, nil)
	got := make(chan *Submit, 1)
	go func() { got <- q.next() }()
	idle := func() int {
		q.mu.Lock()
		defer q.mu.Unlock()
		return q.idle
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := idle(); n != 1 {
			return fmt.Errorf("%d workers waiting, want 1", n)
		}
		return nil
	})
	first := &Submit{ID: 1, Bytes: 1}
	if !q.Submit(first) {
		t.Fatal("Submit woke the waiting worker but did not say so")
	}
	if s := <-got; s != first {
		t.Fatalf("the worker took %v, want job 1", s)
	}
	if q.Submit(&Submit{ID: 2, Bytes: 1}) { // the worker is busy with job 1: no one waits
		t.Fatal("Submit reported a wake-up with no worker waiting")
	}
}
