//go:build chaos

package node_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// docs/CLUSTER.md failure table, "the engine's NATS server cut off with its
// owner": e1 and its node nA are on one server, a follower of the claims'
// stream, whose routes are cut for longer than a lease; nA's standby nB is
// on the other side. nA goes on hearing e1 and e1 nA, but nA's keep-alives
// fail: it stops serving a lease after its last write's send, drops e1 (no
// sign of life through its closed gate), and answers its heartbeats
// `unknown engine`, so e1 frees what nA held (engine_gone) and registers
// again, unanswered while nobody on its side can claim. Healed, e1 is
// served again by nA (the node it names), or by nB if e1's register
// reaches nB before nA's first heartbeat after the heal does (nB has not
// heard nA for over a lease, so it takes over as a standby does: seen once
// under two -race suites), and resyncs. Every request released exactly
// once, and never two nodes serving e1.
func TestRouteCutOfTheEnginesServerWithItsOwner(t *testing.T) {
	r := newRouteCut(t)
	m, k := (r.leader+1)%3, (r.leader+2)%3
	nA := r.node(m, "nA", "")
	nB := r.node(k, "nB", "nA")
	r.kc.waitSeen()
	e := r.engine(m, "nA")
	w := watchServing(t, "e1", nA, nB)
	e.servedBy("nA", 5*cutLease)

	r.rc.Isolate(m)
	cut := time.Now()
	testkit.Eventually(t, 8*cutLease, 50*time.Millisecond, func() error {
		e.step()
		if !nA.node.DroppedHere("e1") {
			return errors.New("nA has not dropped e1")
		}
		if e.c.Live() {
			return fmt.Errorf("e1 has not been told to register again (stats %+v)", e.c.Stats())
		}
		return nil
	})
	dropped := time.Since(cut)
	require.False(t, nA.node.ServingEngine("e1", time.Now()), "nA serves e1 through the cut")
	require.Empty(t, nB.node.Engines(), "nB took e1 over, out of its reach")
	for range 10 { // the engine steps on while nobody serves it
		e.step()
	}

	healing := time.Now()
	r.rc.Heal(m)
	healed := time.Now() // the routes formed again (Heal waits for it)
	settle := r.settled()
	by, served := e.servedByOneOf(10*cutLease, "nA", "nB")
	w.check(t)
	owner, other := nA, nB
	if by == "nB" {
		owner, other = nB, nA
	}
	require.Equal(t, []string{"e1"}, owner.node.Engines())
	require.Empty(t, other.node.Engines())
	logReleases(t, e)
	t.Logf("cut→nA dropped e1 %v; heal→routes formed %v, stream settled %v later, served again by %s %v after the heal began", dropped, healed.Sub(healing), settle, by, served.Sub(healing))
}

// docs/CLUSTER.md failure table, "the engine's NATS server cut off from its
// owner": e1 is on a server of its own (a follower of the claims' stream),
// nA and its standby nB on the two others, and e1's server's routes are cut
// for longer than a lease. e1 hears no node: it declares nA lost, frees its
// requests (node_lost) a lease after its last publish and registers again,
// to no responder; nA, hearing nothing of e1, copies nothing of it after
// lease/2 and drops it after a lease (its releases go nowhere). Healed, e1's
// register is claimed by nA again (nA is live, so its standby leaves it)
// and e1 resyncs. Every request released exactly once, and never two nodes
// serving e1.
func TestRouteCutOfTheEnginesServerFromItsOwner(t *testing.T) {
	r := newRouteCut(t)
	m, k := (r.leader+1)%3, (r.leader+2)%3
	nA := r.node(r.leader, "nA", "")
	nB := r.node(k, "nB", "nA")
	r.kc.waitSeen()
	e := r.engine(m, "nA")
	w := watchServing(t, "e1", nA, nB)
	e.servedBy("nA", 5*cutLease)
	losses := e.c.Stats().NodeLosses

	r.rc.Isolate(m)
	cut := time.Now()
	testkit.Eventually(t, 8*cutLease, 50*time.Millisecond, func() error {
		defer e.step() // after the checks: its release is handed over apart
		if st := e.c.Stats(); st.NodeLosses == losses {
			return fmt.Errorf("e1 has not declared nA lost (stats %+v)", st)
		}
		if !nA.node.DroppedHere("e1") {
			return errors.New("nA has not dropped e1")
		}
		if left := e.unreleased(); len(left) > 0 {
			return fmt.Errorf("requests not freed yet: %v (live %v, stats %+v)", left, e.c.Live(), e.c.Stats())
		}
		return nil
	})
	lost := time.Since(cut)
	require.Empty(t, nB.node.Engines(), "nB took e1 over while nA is live")

	healing := time.Now()
	r.rc.Heal(m)
	healed := time.Now() // the routes formed again (Heal waits for it)
	settle := r.settled()
	served := e.servedBy("nA", 10*cutLease)
	w.check(t)
	require.Empty(t, nB.node.Engines())
	logReleases(t, e)
	t.Logf("cut→e1 freed its requests, nA dropped e1 %v; heal→routes formed %v, stream settled %v later, served again %v after the heal began", lost, healed.Sub(healing), settle, served.Sub(healing))
}

// docs/CLUSTER.md "Fencing the owner", with nodes and an engine: nA's
// server leads the claims' stream and has its routes cut for longer than
// the lease (the other two elect a new leader, 4 to 9 s). nA keeps its
// claim (its writes are refused "in process", no fence) but stops serving;
// e1, on another server, hears nA no more, declares it lost and registers
// again; nB (--standby-for nA), which has not heard nA for a lease, claims
// once the new leader has expired nA's record.
func TestAnOwnerCutOffWithItsStreamLeaderIsFencedBeforeItsStandbyClaims(t *testing.T) {
	r := newRouteCut(t)
	m, k := (r.leader+1)%3, (r.leader+2)%3
	r.ownerMovesToStandby(r.leader, m, k, func() { r.rc.Isolate(r.leader) }, func() { r.rc.Heal(r.leader) })
}

// The same with only the routes between nA's server and the claims'
// stream leader's cut: nB, on the leader's server, hears nA no more, while
// e1, on the third server, hears both. So e1 keeps nA's engine alive
// through the cut: only its lease (its writes fail: no leader reachable,
// no election) shuts nA's gate. Then nA drops e1, e1's next heartbeat is
// answered `unknown engine`, and its register is claimed by nB.
func TestAnOwnerCutOffFromItsStreamLeaderIsFencedBeforeItsStandbyThereClaims(t *testing.T) {
	r := newRouteCut(t)
	m, k := (r.leader+1)%3, (r.leader+2)%3
	r.ownerMovesToStandby(m, r.leader, k, func() { r.rc.CutBetween(m, r.leader) }, func() { r.rc.HealBetween(m, r.leader) })
}

// ownerMovesToStandby runs nA on server a, nB (--standby-for nA) on b and
// e1 (naming nA) on c, cuts routes with cut and checks that nA's gate is
// shut before nB's opens, that e1 resyncs with nB, that every request is
// released exactly once, and that once heal ran nA's claim is fenced and
// e1 stays nB's.
func (r *routeCut) ownerMovesToStandby(a, b, c int, cut, heal func()) {
	t := r.t
	t.Helper()
	nA := r.node(a, "nA", "")
	nB := r.node(b, "nB", "nA")
	r.kc.waitSeen()
	e := r.engine(c, "nA")
	w := watchServing(t, "e1", nA, nB)
	e.servedBy("nA", 5*cutLease)

	cut()
	at := time.Now()
	testkit.Eventually(t, 20*time.Second, 50*time.Millisecond, func() error {
		e.step()
		if st := e.c.Stats(); st.Node != "nB" || !e.c.Live() {
			return fmt.Errorf("e1 not moved to nB: registered with %q, live %v", st.Node, e.c.Live())
		}
		return nil
	})
	moved := time.Since(at)
	// The watch samples every millisecond on its own goroutine, which a
	// loaded run may not have scheduled since nB's gate opened (CI, once:
	// e1 already registered with nB, its gate not yet seen open). Waiting
	// for its first sight of nB leaves the checks below as they were: they
	// compare the watch's own sightings of both gates.
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if first, _ := w.span("nB"); first.IsZero() {
			return errors.New("nB's gate never seen open")
		}
		return nil
	})
	_, lastA := w.span("nA")
	firstB, _ := w.span("nB")
	require.True(t, lastA.Before(firstB), "nA served e1 at %v, after nB began at %v", lastA, firstB)
	require.False(t, nA.node.ServingEngine("e1", time.Now()))
	e.servedBy("nB", 5*cutLease)

	healing := time.Now()
	heal()
	healed := time.Now() // the routes formed again (Heal waits for it)
	settle := r.settled()
	testkit.Eventually(t, 5*cutLease, 20*time.Millisecond, func() error {
		e.step()
		if got := nA.node.Claims(); len(got) != 0 {
			return fmt.Errorf("nA still claims %v", got)
		}
		return nil
	})
	gone := time.Since(healing) // before the checks below, which wait on e1's next releases
	e.servedBy("nB", 5*cutLease)
	w.check(t)
	require.Empty(t, nA.node.Engines())
	require.Equal(t, []string{"e1"}, nB.node.Engines())
	logReleases(t, e)
	t.Logf("cut→nA's gate shut %v, nB's open %v, e1 on nB %v; heal→routes formed %v, stream settled %v later, nA's claim gone %v after the heal began",
		lastA.Sub(at), firstB.Sub(at), moved, healed.Sub(healing), settle, gone)
	unsettled := func(n *env, outcome string) float64 {
		return n.counter("kvactors_cluster_ownership_unsettled_writes_total", outcome)
	}
	t.Logf("claim writes unsettled by their reply: nB landed %v, in process %v, unexplained %v; nA in process %v",
		unsettled(nB, "landed"), unsettled(nB, "in_process"), unsettled(nB, "unexplained"), unsettled(nA, "in_process"))
}

// A partial partition: only the routes between nA's server and the claims'
// stream leader's are cut; both still reach the third server, where e1 and
// nA's standby nB are (NATS routes do not relay, so nA's writes reach no
// leader). Everyone still hears nA, so e1 never takes it for lost and nB,
// whose primary is live, leaves e1 to it; nA stops serving a lease after
// its last write's send and drops e1, whose registers then go unclaimed for
// as long as the cut lasts (unless the claims' stream moves to a leader
// nA reaches): docs/CLUSTER.md failure table says so. The test holds the
// cut for three leases of e1's steps: nB never takes e1 meanwhile, then,
// healed, nA serves it, and every request is released once.
func TestAnOwnerCutOffFromItsStreamLeaderAloneServesAgainOnceHealed(t *testing.T) {
	r := newRouteCut(t)
	m, k := (r.leader+1)%3, (r.leader+2)%3
	nA := r.node(m, "nA", "")
	nB := r.node(k, "nB", "nA")
	r.kc.waitSeen()
	e := r.engine(k, "nA")
	w := watchServing(t, "e1", nA, nB)
	e.servedBy("nA", 5*cutLease)

	r.rc.CutBetween(m, r.leader)
	cut := time.Now()
	testkit.Eventually(t, 4*cutLease, 50*time.Millisecond, func() error {
		e.step()
		if !nA.node.DroppedHere("e1") || e.c.Live() {
			return fmt.Errorf("nA has not dropped e1 (it serves e1: %v; e1 live: %v)", nA.node.ServingEngine("e1", time.Now()), e.c.Live())
		}
		return nil
	})
	dropped := time.Since(cut)
	steps := time.NewTicker(50 * time.Millisecond) // the engine's step period over an observation window
	defer steps.Stop()
	servedInCut := false
	for end := time.Now().Add(3 * cutLease); time.Now().Before(end); <-steps.C {
		e.step()
		// Usually nobody serves e1 now. But the claims' stream may move to
		// a leader nA's server reaches (its raft peer there no longer hears
		// the leader and may call an election; seen once under -race in
		// CI), and then nA claims e1 again: allowed, as long as it is nA
		// (nB leaves a live primary's engine alone) and the watcher sees
		// no two gates open at once.
		servedInCut = servedInCut || e.c.Live()
		require.Empty(t, nB.node.Engines(), "nB took e1 while nA is live")
		require.Zero(t, e.c.Stats().NodeLosses, "e1 took nA, which it hears, for lost")
	}
	if servedInCut {
		t.Log("e1 was served again during the cut: the claims' stream moved to a leader nA reaches")
	}

	healing := time.Now()
	r.rc.HealBetween(m, r.leader)
	healed := time.Now() // the routes formed again (Heal waits for it)
	settle := r.settled()
	served := e.servedBy("nA", 10*cutLease)
	w.check(t)
	require.Empty(t, nB.node.Engines())
	logReleases(t, e)
	t.Logf("cut→nA dropped e1 %v; heal→routes formed %v, stream settled %v later, served again %v after the heal began", dropped, healed.Sub(healing), settle, served.Sub(healing))
}
