package transfer

import (
	"fmt"
	"testing"

	"github.com/asynkron/protoactor-go/actor"
)

// lastPerOwner marks every completion but each owner's last in the batch
// (JobDone.More): an owner whose last completion carried More would never
// take the decision its completions call for, so this is checked on both
// paths (a scan up to 8 completions, a map past that) against a plain
// reference, with owners interleaved. One scratch set serves every batch
// (the actor keeps one), and is left empty.
func TestLastPerOwnerMarksAllButEachOwnersLast(t *testing.T) {
	seen := map[*actor.PID]struct{}{}
	owners := []*actor.PID{actor.NewPID("l", "a"), actor.NewPID("l", "b"), actor.NewPID("l", "c")}
	for _, n := range []int{1, 2, 5, 8, 9, 13, 40} {
		var done []*copyDone
		for i := range n {
			done = append(done, &copyDone{job: &Submit{Owner: owners[(i*7+i/3)%len(owners)]}})
		}
		got := lastPerOwner(nil, done, seen)
		if len(seen) != 0 {
			t.Fatalf("%d completions: the scratch set keeps %d owners", n, len(seen))
		}
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
