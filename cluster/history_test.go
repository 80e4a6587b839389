package cluster

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/stretchr/testify/require"
)

// callLog records each Owners call of the contenders of a test (node,
// call, engine, call and return times, result), written out when it fails.
// A nil log records nothing.
type callLog struct {
	start time.Time
	mu    sync.Mutex
	lines []string
}

func (l *callLog) add(node, op, engine string, call time.Time, result string) {
	if l == nil {
		return
	}
	ret := time.Since(l.start)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("%s [%v, %v] %s %s: %s", node, call.Sub(l.start), ret, op, engine, result))
}

// kvOpKind is a bucket write: the three kinds Owners makes.
type kvOpKind uint8

const (
	kvCreate kvOpKind = iota
	kvUpdate
	kvDelete
)

func (k kvOpKind) String() string { return [...]string{"create", "update", "delete"}[k] }

// kvIn is one write: its key, the revision it expects (update, delete; 0:
// any for a delete), the record it writes (the writer's identity, closed)
// and its call and return times (ns since the history began; return
// math.MaxInt64 when its outcome is unknown).
type kvIn struct {
	kind      kvOpKind
	key       string
	expect    uint64
	writer    string
	closed    bool
	call, ret int64
}

// kvOut is its result: acknowledged at rev, or failed: any failure of a
// write is an unknown outcome. A timeout may have landed; at a heal the
// deposed leader refuses a write (10164, or a stale "wrong last sequence")
// that the new leader commits (docs/CLUSTER.md "A heal, seen by the
// owner"), and the writer gets whichever reply comes first.
type kvOut struct {
	ok  bool
	rev uint64
	err string
}

// regState is one key of the bucket, as ownershipModel sees it: its record
// (present, the revision, the writer, closed, the earliest its write can
// have landed), or none. lb: rev is a lower bound only (a write whose
// outcome is unknown landed, or a delete left a marker of its own
// revision).
type regState struct {
	present bool
	rev     uint64
	lb      bool
	writer  string
	closed  bool
	at      int64
}

// ownershipModel is the bucket as docs/CLUSTER.md relies on it, per key:
//
//   - a compare-and-set register: a create succeeds only on no record; an
//     update or a delete only on the revision it expects, which must be the
//     record's; each acknowledged write gets a revision past the last;
//   - a record lapses a lease after its write was stamped (no sooner than
//     it landed), the servers' clocks up to the clock-skew margin early
//     ("Fencing the owner"): a create may find a record gone only that
//     long after the record's write;
//   - ownership: a node replaces a record (update) only when it is its own
//     (a keep-alive, a leave), a closed marker, or lapsed.
//
// A write whose outcome is unknown may or may not have landed, any time
// after its call (and after what it needed: a lapse); its revision is then
// unknown (past the last). Every write on its record lands after it.
func ownershipModel(lease, skew time.Duration) porcupine.Model {
	matches := func(s regState, expect uint64) bool { return s.rev == expect || (s.lb && expect > s.rev) }
	// apply is in's write landing on s at rev (lb: unknown, past it),
	// between in's call (or the record's own landing) and its return.
	apply := func(s regState, in kvIn, rev uint64, lb bool) (regState, bool) {
		at := max(in.call, s.at)
		lapse := func() { at = max(at, s.at+int64(lease-skew)) }
		switch in.kind {
		case kvCreate:
			if !lb && rev <= s.rev {
				return s, false
			}
			if s.present {
				lapse()
			}
		case kvUpdate:
			if !s.present || !matches(s, in.expect) || (!lb && rev <= in.expect) {
				return s, false
			}
			if s.writer != in.writer && !s.closed {
				lapse() // another node's record: only once lapsed
			}
		case kvDelete:
			if !s.present || (in.expect != 0 && !matches(s, in.expect)) || at > in.ret {
				return s, false
			}
			return regState{rev: max(s.rev, in.expect), lb: true, at: at}, true
		}
		if at > in.ret {
			return s, false
		}
		return regState{present: true, rev: rev, lb: lb, writer: in.writer, closed: in.closed, at: at}, true
	}
	// The states a key may be in, as one set (porcupine's power-set
	// construction, by hand): states alike but for when their record can
	// have landed keep the earliest, which allows everything the later
	// would. Without it each write of unknown outcome added a state, and a
	// history of a few hundred took porcupine tens of seconds.
	canon := func(states []regState) regStates {
		slices.SortFunc(states, func(a, b regState) int {
			if c := cmp.Compare(a.key(), b.key()); c != 0 {
				return c
			}
			return cmp.Compare(a.at, b.at)
		})
		return slices.CompactFunc(states, func(a, b regState) bool { return a.key() == b.key() })
	}
	return porcupine.Model{
		Partition: byKey,
		Init:      func() any { return regStates{{}} },
		Step: func(state, input, output any) (bool, any) {
			in, out := input.(kvIn), output.(kvOut)
			var next []regState
			for _, s := range state.(regStates) {
				if out.ok {
					if n, ok := apply(s, in, out.rev, false); ok {
						next = append(next, n)
					}
					continue
				}
				next = append(next, s) // not landed
				if n, ok := apply(s, in, max(s.rev, in.expect), true); ok {
					next = append(next, n)
				}
			}
			return len(next) > 0, canon(next)
		},
		Equal: func(a, b any) bool { return slices.Equal(a.(regStates), b.(regStates)) },
		Hash: func(state any) uint64 {
			h := fnv.New64a()
			for _, s := range state.(regStates) {
				fmt.Fprintf(h, "%s|%d;", s.key(), s.at)
			}
			return h.Sum64()
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(kvIn), output.(kvOut)
			res := fmt.Sprintf("rev %d", out.rev)
			if !out.ok {
				res = "unknown: " + out.err
			}
			return fmt.Sprintf("%s(%s, expect %d, %s closed=%v) -> %s", in.kind, in.key, in.expect, in.writer, in.closed, res)
		},
		DescribeState: func(state any) string {
			var b strings.Builder
			for _, s := range state.(regStates) {
				if !s.present {
					fmt.Fprintf(&b, "none (rev %d, lb %v); ", s.rev, s.lb)
					continue
				}
				fmt.Fprintf(&b, "%s rev %d (lb %v) closed=%v landed from %v; ", s.writer, s.rev, s.lb, s.closed, time.Duration(s.at))
			}
			return b.String()
		},
	}
}

// regStates is the set of states a key may be in (ownershipModel's).
type regStates []regState

// key is s but for when its record can have landed.
func (s regState) key() string {
	return fmt.Sprintf("%v/%d/%v/%s/%v", s.present, s.rev, s.lb, s.writer, s.closed)
}

// byKey partitions a history by key (porcupine checks each alone), in the
// order the keys first appear.
func byKey(history []porcupine.Operation) [][]porcupine.Operation {
	at := map[string]int{}
	var out [][]porcupine.Operation
	for _, op := range history {
		k := op.Input.(kvIn).key
		i, ok := at[k]
		if !ok {
			i = len(out)
			at[k] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], op)
	}
	return out
}

// The model itself: a handover the lease allows passes, one it does not
// fails, and an unknown write may explain a revision nobody was told of.
func TestOwnershipModel(t *testing.T) {
	lease, skew := time.Second, 100*time.Millisecond
	ms := func(n int64) int64 { return n * int64(time.Millisecond) }
	op := func(client int, in kvIn, ok bool, rev uint64) porcupine.Operation {
		ret := in.ret
		if !ok {
			in.ret, ret = math.MaxInt64, math.MaxInt64
		}
		return porcupine.Operation{ClientId: client, Input: in, Call: in.call, Output: kvOut{ok: ok, rev: rev}, Return: ret}
	}
	create := func(c int, w string, call, ret int64, ok bool, rev uint64) porcupine.Operation {
		return op(c, kvIn{kind: kvCreate, key: "e", writer: w, call: ms(call), ret: ms(ret)}, ok, rev)
	}
	update := func(c int, w string, expect uint64, call, ret int64, ok bool, rev uint64) porcupine.Operation {
		return op(c, kvIn{kind: kvUpdate, key: "e", expect: expect, writer: w, call: ms(call), ret: ms(ret)}, ok, rev)
	}
	m := ownershipModel(lease, skew)
	for _, tc := range []struct {
		name string
		ops  []porcupine.Operation
		want bool
	}{
		{"a handover after the lease", []porcupine.Operation{create(0, "a", 0, 5, true, 1), create(1, "b", 890, 905, true, 3)}, true},
		{"a create over a live record", []porcupine.Operation{create(0, "a", 0, 5, true, 1), create(1, "b", 100, 110, true, 3)}, false},
		{"keep-alives then a create too soon", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			update(0, "a", 1, 500, 505, true, 2), create(1, "b", 1000, 1010, true, 4)}, false},
		{"an update on another node's live record", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			update(1, "b", 1, 100, 105, true, 2)}, false},
		{"a revision going back", []porcupine.Operation{create(0, "a", 0, 5, true, 5), update(0, "a", 5, 100, 105, true, 4)}, false},
		{"an unknown write explains a revision", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			update(0, "a", 1, 100, 0, false, 0), update(0, "a", 7, 300, 305, true, 8)}, true},
		{"an unknown create may land once the record lapsed", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			create(1, "b", 10, 0, false, 0), update(1, "b", 7, 1000, 1005, true, 8)}, true},
		{"an unknown create cannot land on a live record", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			create(1, "b", 10, 0, false, 0), update(1, "b", 7, 300, 305, true, 8)}, false},
		{"an unknown update of another's live record cannot land", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			update(1, "b", 1, 10, 0, false, 0), update(1, "b", 7, 300, 305, true, 8)}, false},
		{"a leave's closed marker is taken at once", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			op(0, kvIn{kind: kvUpdate, key: "e", expect: 1, writer: "a", closed: true, call: ms(10), ret: ms(15)}, true, 2),
			update(1, "b", 2, 20, 25, true, 3)}, true},
		{"a released record is taken at once", []porcupine.Operation{create(0, "a", 0, 5, true, 1),
			op(0, kvIn{kind: kvDelete, key: "e", expect: 1, call: ms(10), ret: ms(15)}, true, 0),
			create(1, "b", 20, 25, true, 3)}, true},
		{"a stale revision", []porcupine.Operation{create(0, "a", 0, 5, true, 1), update(0, "a", 1, 100, 105, true, 2),
			update(0, "a", 1, 200, 205, true, 3)}, false},
	} {
		res := porcupine.CheckOperationsTimeout(m, tc.ops, 10*time.Second)
		require.Equal(t, tc.want, res == porcupine.Ok, "%s: %s", tc.name, res)
	}
}
