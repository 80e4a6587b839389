//go:build chaos

package cluster

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
)

var (
	historyRun  = flag.Duration("ownership-history", 0, "how long TestOwnershipHistoryUnderRouteCuts injects faults (default 8s)")
	historySeed = flag.Uint64("ownership-history-seed", 0, "TestOwnershipHistoryUnderRouteCuts' seed (0: from the clock, logged)")
)

// TestOwnershipHistoryUnderRouteCuts checks docs/CLUSTER.md's ownership
// guarantees on a recorded history, with the faults a NATS cluster meets
// between its servers: three Owners, each on its own server of a 3-server
// cluster whose routes run through cuttable links, contend for three
// engines (registers naming no node, keep-alives every lease/4, releases
// and leaves) while the claims' stream leader is cut off from both
// followers (deposed but not yet told), a claim holder's server is (the
// leadership stepped down first if it is there), the route between a
// holder's server and the leader alone is cut, or a server is stopped and
// restarted. Two checks:
//
//   - every write of the bucket (create, update, delete: call, return,
//     result) is checked with porcupine against ownershipModel, the bucket
//     as a compare-and-set register per key whose records lapse a lease
//     (less the clock-skew margin) after their write, and whose records a
//     node replaces only when they are its own, closed or lapsed;
//   - every interval in which a node may serve an engine (Owners.Serving's
//     rule: from its claim's acknowledgement to its last write's send plus
//     the lease less the margin, or the release or leave) is recorded, and
//     no two nodes' intervals of one engine overlap (servingLog).
//
// It runs 8 s of faults by default (11–18 s in all under -race, 2 or 3
// faults, 2 or 3 lapse takeovers); -ownership-history=60s runs longer, and
// from 30 s fails if no record lapsed into another node's hands;
// -ownership-history-seed=N replays a fault schedule and the nodes'
// choices (the timings are the machine's). The model and the recorder are
// in history_test.go, whose TestOwnershipModel runs in the default suite.
func TestOwnershipHistoryUnderRouteCuts(t *testing.T) {
	run := 8 * time.Second
	if *historyRun > 0 {
		run = *historyRun
	}
	seed := *historySeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (-ownership-history-seed=%d replays it)", seed, seed)
	const lease = testLease
	engines := []string{"e1", "e2", "e3"}
	c := testkit.NATSClusterWithRouteLinks(t, 3)
	openOwnersLease(t, c.Connect(0), "setup", "", 3, lease) // creates the bucket

	hist := &kvHistory{start: time.Now()}
	calls := &callLog{start: hist.start}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := newServingLog(t)
	nodes := make([]*exclusiveNode, 3)
	ncs := make([]*nats.Conn, 3)
	for i := range nodes {
		name := fmt.Sprintf("gpu-%d", i)
		ncs[i] = c.Connect(i)
		o := openOwnersLease(t, ncs[i], name, "", 3, lease)
		acks := &ackedKV{KeyValue: &recordedKV{KeyValue: o.kv, h: hist, client: i}, at: map[string]time.Time{}}
		o.kv = acks
		nodes[i] = &exclusiveNode{name: name, o: o, acks: acks, log: log, engines: engines, lease: lease,
			rng: rand.New(rand.NewPCG(seed, uint64(i))), releases: 80, leaves: 160, calls: calls}
	}
	skew := nodes[0].o.cfg.ClockSkew
	wg := runNodes(ctx, nodes)

	// Faults, on the test goroutine (testkit.Cluster's methods must be),
	// each held two to three leases (a lapse, and on the majority's side
	// an election, fit in it), then healed (Heal and Restart wait for
	// the cluster to form again) and half a lease of calm. Most aim at a
	// node holding a claim (its server cut off, or cut from the claims'
	// stream leader alone): its claims lapse and others take them over.
	rng := rand.New(rand.NewPCG(seed, 3))
	// serverOf is the server node k's client is on: it fails over when its
	// server stops, and stays where it went.
	serverOf := func(k int) int {
		for j := range c.Size() {
			if srv := c.Server(j); srv != nil && srv.ID() == ncs[k].ConnectedServerId() {
				return j
			}
		}
		return -1
	}
	// holder is the server of a node holding a claim, one on a follower of
	// the claims' stream if any (cut off, its claims lapse and the majority,
	// which has the leader, takes them over), else any server.
	holder := func(leader int) int {
		pick := -1
		for _, k := range rng.Perm(len(nodes)) {
			if j := serverOf(k); j >= 0 && len(nodes[k].o.Mine()) > 0 && (pick < 0 || j != leader) {
				pick = j
			}
		}
		if pick < 0 {
			pick = rng.IntN(len(nodes))
		}
		return pick
	}
	admin := c.Connect(0)
	var faults []string
	for deadline := time.Now().Add(run); time.Now().Before(deadline); {
		hold := 2*lease + time.Duration(rng.Int64N(int64(lease)))
		leader := streamLeader(c.Cluster)
		i, k := holder(leader), rng.IntN(6)
		if k > 0 && k < 5 && i == leader && leader >= 0 {
			// The holder's server leads the claims' stream: cut off, nobody
			// could write (nor lapse its records) until an election. Move
			// the leadership first, a fault of its own.
			_, err := admin.Request("$JS.API.STREAM.LEADER.STEPDOWN.KV_"+nodes[0].o.cfg.Bucket, nil, lease)
			testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
				if l := streamLeader(c.Cluster); l < 0 || l == leader {
					return fmt.Errorf("the claims' stream still led by s%d after a step-down (%v)", leader, err)
				}
				return nil
			})
			faults = append(faults, fmt.Sprintf("step-down of s%d", leader))
			leader = streamLeader(c.Cluster)
		}
		switch {
		case k == 0 && leader >= 0:
			// Cut off, it leads on until it finds it lost its quorum.
			faults = append(faults, fmt.Sprintf("isolate s%d (the claims' leader) %v", leader, hold))
			c.Isolate(leader)
			pace(ctx, hold)
			c.Heal(leader)
		case k <= 2 && leader >= 0 && leader != i:
			faults = append(faults, fmt.Sprintf("cut s%d-s%d (a holder's, the leader's) %v", i, leader, hold))
			c.CutBetween(i, leader)
			pace(ctx, hold)
			c.HealBetween(i, leader)
		case k <= 4:
			faults = append(faults, fmt.Sprintf("isolate s%d (a holder's) %v", i, hold))
			c.Isolate(i)
			pace(ctx, hold)
			c.Heal(i)
		default:
			faults = append(faults, fmt.Sprintf("stop s%d %v", i, hold))
			c.Stop(i)
			pace(ctx, hold)
			c.Restart(i)
		}
		pace(ctx, lease/2)
	}
	cancel()
	wg.Wait()

	handovers := log.check(t)
	ops := hist.operations()
	checked := time.Now()
	res, info := porcupine.CheckOperationsVerbose(ownershipModel(lease, skew), ops, time.Minute)
	var ok, unknown int
	failures := map[string]int{}
	for _, op := range ops {
		if out := op.Output.(kvOut); out.ok {
			ok++
		} else {
			unknown++
			failures[op.Input.(kvIn).kind.String()+": "+strings.Map(func(r rune) rune {
				if r >= '0' && r <= '9' {
					return 'N'
				}
				return r
			}, out.err)]++
		}
	}
	for f, n := range failures {
		t.Logf("%4d× %s", n, f)
	}
	t.Logf("faults: %s", strings.Join(faults, "; "))
	takeovers := lapseTakeovers(ops)
	t.Logf("%d takeovers of a lapsed record by another node", takeovers)
	t.Logf("%d bucket writes (%d acknowledged, %d failed: outcome unknown), %d handovers: %s (checked in %v)", len(ops), ok, unknown, handovers, res, time.Since(checked))
	if res == porcupine.Unknown {
		t.Errorf("porcupine could not decide on the history within its minute: a run this long needs a longer check")
	}
	if res == porcupine.Illegal {
		path := filepath.Join(os.TempDir(), fmt.Sprintf("ownership-history-%d.html", seed))
		if err := porcupine.VisualizePath(ownershipModel(lease, skew), info, path); err == nil {
			t.Logf("porcupine's view of the history: %s", path)
		}
		t.Errorf("the bucket's write history is not one ownershipModel allows:\n%s", describePartials(ops, info))
	}
	if t.Failed() { // the whole record, for the hunt: every Owners call, then every bucket write
		path := filepath.Join(os.TempDir(), fmt.Sprintf("ownership-history-%d.txt", seed))
		var b strings.Builder
		for _, l := range calls.lines {
			fmt.Fprintln(&b, l)
		}
		for _, op := range ops {
			fmt.Fprintf(&b, "c%d [%v, %v] %s\n", op.ClientId, time.Duration(op.Call), time.Duration(op.Return),
				ownershipModel(lease, skew).DescribeOperation(op.Input, op.Output))
		}
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err == nil {
			t.Logf("every call and write (times from the history's start): %s", path)
		}
	}
	require.Positive(t, handovers, "no engine changed hands: the faults exercised nothing")
	if run >= 30*time.Second { // a short run may see none (3 faults or so)
		require.Positive(t, takeovers, "no record lapsed into another node's hands: no fence was exercised")
	}
}

// lapseTakeovers counts the acknowledged writes that replaced another
// node's record, neither released nor closed, by the acknowledged writes'
// order of return (a failed write that landed between is not seen).
func lapseTakeovers(ops []porcupine.Operation) int {
	n := 0
	for _, part := range byKey(ops) {
		acked := slices.DeleteFunc(slices.Clone(part), func(op porcupine.Operation) bool { return !op.Output.(kvOut).ok })
		slices.SortFunc(acked, func(a, b porcupine.Operation) int { return cmp.Compare(a.Return, b.Return) })
		for i := 1; i < len(acked); i++ {
			prev, in := acked[i-1].Input.(kvIn), acked[i].Input.(kvIn)
			if prev.kind != kvDelete && !prev.closed && in.kind != kvDelete && prev.writer != in.writer {
				n++
			}
		}
	}
	return n
}

// describePartials shows each key porcupine could not linearize whole: the
// last writes of the longest prefix it could, then the first it could not
// place after them, each with its times (a failed write's return is open).
func describePartials(ops []porcupine.Operation, info porcupine.LinearizationInfo) string {
	var b strings.Builder
	line := func(op porcupine.Operation) {
		in, out := op.Input.(kvIn), op.Output.(kvOut)
		ret := "open"
		if out.ok {
			ret = time.Duration(op.Return).String()
		}
		fmt.Fprintf(&b, "  c%d [%v, %s] %s %s expect %d by %s closed=%v: ok=%v rev %d %s\n", op.ClientId,
			time.Duration(op.Call), ret, in.kind, in.key, in.expect, in.writer, in.closed, out.ok, out.rev, out.err)
	}
	parts := byKey(ops)
	for i, part := range info.PartialLinearizationsOperations() {
		longest := []porcupine.Operation{}
		for _, l := range part {
			if len(l) > len(longest) {
				longest = l
			}
		}
		if i >= len(parts) || len(longest) == len(parts[i]) {
			continue
		}
		fmt.Fprintf(&b, "key %s: %d of %d writes linearized; the last of them:\n", parts[i][0].Input.(kvIn).key, len(longest), len(parts[i]))
		for _, op := range longest[max(0, len(longest)-12):] {
			line(op)
		}
		placed := map[porcupine.Operation]bool{}
		for _, op := range longest {
			placed[op] = true
		}
		b.WriteString(" not placed after them (the first by call):\n")
		n := 0
		for _, op := range parts[i] {
			if !placed[op] && n < 6 {
				line(op)
				n++
			}
		}
	}
	return b.String()
}

// kvHistory records every bucket write of the Owners under test.
type kvHistory struct {
	start time.Time
	mu    sync.Mutex
	ops   []porcupine.Operation
}

func (h *kvHistory) now() int64 { return int64(time.Since(h.start)) }

func (h *kvHistory) add(client int, in kvIn, rev uint64, err error) {
	in.ret = h.now()
	out := kvOut{ok: err == nil, rev: rev}
	if err != nil {
		out.err = err.Error()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ops = append(h.ops, porcupine.Operation{ClientId: client, Input: in, Call: in.call, Output: out, Return: in.ret})
}

// operations is the history for porcupine: a failed write's return is
// open (it may land any time after its call).
func (h *kvHistory) operations() []porcupine.Operation {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]porcupine.Operation, len(h.ops))
	for i, op := range h.ops {
		if !op.Output.(kvOut).ok {
			in := op.Input.(kvIn)
			in.ret = math.MaxInt64
			op.Input, op.Return = in, math.MaxInt64
		}
		out[i] = op
	}
	return out
}

// recordedKV is a KeyValue whose writes are recorded in h.
type recordedKV struct {
	jetstream.KeyValue
	h      *kvHistory
	client int
}

func (k *recordedKV) in(kind kvOpKind, key string, value []byte, expect uint64) kvIn {
	in := kvIn{kind: kind, key: key, expect: expect}
	if value != nil {
		r, err := ownership.DecodeRecord(value)
		if err != nil {
			panic(fmt.Sprintf("a write of an undecodable record: %v", err)) // Owners writes only its records
		}
		in.writer, in.closed = r.Identity.String(), r.Closed
	}
	in.call = k.h.now()
	return in
}

func (k *recordedKV) Create(ctx context.Context, key string, value []byte, opts ...jetstream.KVCreateOpt) (uint64, error) {
	in := k.in(kvCreate, key, value, 0)
	rev, err := k.KeyValue.Create(ctx, key, value, opts...)
	k.h.add(k.client, in, rev, err)
	return rev, err
}

func (k *recordedKV) Update(ctx context.Context, key string, value []byte, revision uint64) (uint64, error) {
	in := k.in(kvUpdate, key, value, revision)
	rev, err := k.KeyValue.Update(ctx, key, value, revision)
	k.h.add(k.client, in, rev, err)
	return rev, err
}

func (k *recordedKV) Delete(ctx context.Context, key string, opts ...jetstream.KVDeleteOpt) error {
	in := k.in(kvDelete, key, nil, deleteRevision(opts))
	err := k.KeyValue.Delete(ctx, key, opts...)
	k.h.add(k.client, in, 0, err)
	return err
}

// deleteRevision is the revision a delete's jetstream.LastRevision option
// expects (0: none), read back from the option: nats.go keeps it in an
// unexported struct its option function fills.
func deleteRevision(opts []jetstream.KVDeleteOpt) uint64 {
	var rev uint64
	for _, opt := range opts {
		f := reflect.ValueOf(opt)
		if f.Kind() != reflect.Func || f.Type().NumIn() != 1 || f.Type().In(0).Kind() != reflect.Pointer {
			continue
		}
		o := reflect.New(f.Type().In(0).Elem())
		f.Call([]reflect.Value{o})
		if r := o.Elem().FieldByName("revision"); r.IsValid() && r.Uint() != 0 {
			rev = r.Uint()
		}
	}
	if rev == 0 && len(opts) > 0 { // Owners deletes only on a revision: nats.go's option changed
		panic("recordedKV: a delete's expected revision could not be read from its options")
	}
	return rev
}

// Writes Owners does not make: recorded nowhere, so they fail loudly
// rather than leave a gap in the history.
func (k *recordedKV) Put(context.Context, string, []byte) (uint64, error) {
	panic("recordedKV: Put is not in the history's model")
}

func (k *recordedKV) PutString(context.Context, string, string) (uint64, error) {
	panic("recordedKV: PutString is not in the history's model")
}

func (k *recordedKV) Purge(context.Context, string, ...jetstream.KVDeleteOpt) error {
	panic("recordedKV: Purge is not in the history's model")
}
