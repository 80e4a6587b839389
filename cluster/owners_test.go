package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
)

// testLease is the shortest lease nats-server allows for a bucket whose
// expiries leave markers (1 s).
const testLease = time.Second

// ownersBucket is the claims' KV bucket, as another client reads it.
func ownersBucket(t *testing.T, nc *nats.Conn) jetstream.KeyValue {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	kv, err := js.KeyValue(ctxT(t), "kvactors_owners")
	require.NoError(t, err)
	return kv
}

// isGone reports whether a Get error says the record is not there
// (deleted, or never written / purged).
func isGone(err error) bool {
	return errors.Is(err, jetstream.ErrKeyDeleted) || errors.Is(err, jetstream.ErrKeyNotFound)
}

func openOwners(t *testing.T, nc *nats.Conn, node, standbyFor string, replicas int) *Owners {
	t.Helper()
	return openOwnersLease(t, nc, node, standbyFor, replicas, testLease)
}

// openOwnersLease is openOwners with a lease of its own (the bucket's, when
// it creates the bucket).
func openOwnersLease(t *testing.T, nc *nats.Conn, node, standbyFor string, replicas int, lease time.Duration) *Owners {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var o *Owners
	// Bucket creation needs a JetStream meta leader; right after a server
	// stop there may briefly be none.
	testkit.Eventually(t, 10*time.Second, 50*time.Millisecond, func() error {
		o, err = OpenOwners(ctx, js, Config{Node: node, Boot: node + "-boot1", StandbyFor: standbyFor, Lease: lease, Replicas: replicas}, nil)
		return err
	})
	return o
}

// eventuallyOwner waits until o reads engine's record naming node (any
// node if ""): reads
// are direct gets that any replica may serve, and a replica may lag the
// quorum that acknowledged the write.
func eventuallyOwner(t *testing.T, o *Owners, engine, node string) *ownership.Entry {
	t.Helper()
	var got *ownership.Entry
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		e, err := o.Get(context.Background(), engine)
		if err != nil {
			return err
		}
		if e == nil || (node != "" && e.Node != node) {
			return fmt.Errorf("owner of %s reads %+v, want %s", engine, e, node)
		}
		got = e
		return nil
	})
	return got
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// attempt runs f with a context of its own (5 s): each try of a wait is
// bounded alone, not by what a context the test began with has left (a
// slow election would use that up before the wait's own deadline).
func attempt(f func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return f(ctx)
}

// "a register naming no node is answered by exactly one node (the one whose
// compare-and-set won)": three nodes on three NATS servers race for each
// of 20 engines; each ends with exactly one server, and the others ignore
// naming that winner.
func TestConcurrentClaimsOnThreeServersEndWithOneOwner(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	nodes := make([]*Owners, 3)
	for i := range nodes {
		nodes[i] = openOwners(t, c.Connect(i), fmt.Sprintf("gpu-%d", i), "", 3)
	}
	ctx := ctxT(t)
	for e := range 20 {
		engine := fmt.Sprintf("e%d", e)
		decisions := make([]ownership.Decision, 3)
		errs := make([]error, 3)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, o := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start // closed below, before Wait: never blocks past the test
				decisions[i], errs[i] = o.Resolve(ctx, engine, Request{Register: true, Local: true})
			}()
		}
		close(start)
		wg.Wait()
		var winner string
		for i, d := range decisions {
			require.NoError(t, errs[i], "node %d on %s", i, engine)
			if d.Action == ownership.Serve {
				require.Empty(t, winner, "%s: two owners (%s and gpu-%d)", engine, winner, i)
				winner = fmt.Sprintf("gpu-%d", i)
			}
		}
		require.NotEmpty(t, winner, "%s: no owner: %+v", engine, decisions)
		for i, d := range decisions {
			if d.Action != ownership.Serve {
				require.Equal(t, ownership.Ignore, d.Action, "node %d", i)
				require.Equal(t, winner, d.Owner, "node %d names the owner", i)
			}
		}
		eventuallyOwner(t, nodes[0], engine, winner)
	}
}

// The owner keeps its engine while it renews; once it stops, its standby
// takes the engine over no sooner than a lease after the owner's last
// write, and the old owner's next keep-alive is fenced by the revision.
func TestStandbyTakesOverAfterTheLeaseAndTheOldOwnerIsFenced(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	owner := openOwners(t, c.Connect(0), "gpu-0", "", 3)
	standby := openOwners(t, c.Connect(1), "gpu-0b", "gpu-0", 3)
	other := openOwners(t, c.Connect(2), "gpu-9", "", 3)
	ctx := ctxT(t)
	reg := Request{Register: true, Local: true, SpecNode: "gpu-0"}

	mustServe(t, owner, "e1", reg)

	// Two leases of keep-alives: the standby never gets the engine.
	tick := time.NewTicker(testLease / 8) // the keep-alive period, as a node's would be
	defer tick.Stop()
	until := time.Now().Add(2 * testLease)
	for time.Now().Before(until) {
		_, err := owner.KeepAlive(ctx, "e1")
		require.NoError(t, err)
		d, err := standby.Resolve(ctx, "e1", reg)
		require.NoError(t, err)
		require.Equal(t, ownership.Ignore, d.Action)
		require.Equal(t, "gpu-0", d.Owner)
		testkit.Recv(t, tick.C, testLease, "the next keep-alive tick")
	}
	require.True(t, owner.Serving("e1", time.Now()))

	// The owner stops renewing (as if killed). Its last write:
	lastSent := time.Now()
	_, err := owner.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	var tookOver time.Time
	testkit.Eventually(t, 10*testLease, 20*time.Millisecond, func() error {
		// A node that neither is named nor stands by never claims it.
		d, err := other.Resolve(ctx, "e1", reg)
		require.NoError(t, err)
		require.NotEqual(t, ownership.Serve, d.Action, "a node neither named nor standby took the engine")
		d, err = standby.Resolve(ctx, "e1", reg)
		if err != nil {
			return err
		}
		if d.Action != ownership.Serve {
			return fmt.Errorf("standby: %v (%s)", d.Action, d.Reason)
		}
		tookOver = time.Now()
		return nil
	})
	require.GreaterOrEqual(t, tookOver.Sub(lastSent), testLease, "taken over before the lease ran out")
	require.False(t, owner.Serving("e1", time.Now()), "the old owner's local lease has run out too")

	_, err = owner.KeepAlive(ctx, "e1")
	require.ErrorIs(t, err, ErrFenced)
	require.ErrorIs(t, owner.Release(ctx, "e1"), ErrNotMine, "a fenced claim is forgotten")
	got := eventuallyOwner(t, other, "e1", "gpu-0b")
	require.Equal(t, standby.Revision("e1"), got.Revision)

	// The engine re-registers naming its first node: the standby serves it,
	// the restarted first node stays silent.
	mustServe(t, standby, "e1", reg)
	d, err := owner.Resolve(ctx, "e1", reg)
	require.NoError(t, err)
	require.Equal(t, ownership.Ignore, d.Action)
	require.Equal(t, "gpu-0b", d.Owner)
}

// "a register naming another node than the live owner is refused by the
// owner with an error naming itself"; other nodes stay silent.
func TestRegisterNamingAnotherNodeIsRefusedByTheOwner(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	a := openOwners(t, nc, "gpu-0", "", 1)
	b := openOwners(t, testkit.Connect(t, s), "gpu-1", "", 1)
	ctx := ctxT(t)
	mustServe(t, a, "e1", Request{Register: true, Local: true})
	d, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true, SpecNode: "gpu-1"})
	require.NoError(t, err)
	require.Equal(t, ownership.Refuse, d.Action)
	require.Contains(t, ownership.RefusalError(d.Owner, "gpu-1"), "owned by node gpu-0")
	d, err = b.Resolve(ctx, "e1", Request{Register: true, Local: true, SpecNode: "gpu-1"})
	require.NoError(t, err)
	require.Equal(t, ownership.Ignore, d.Action)

	// Released: the named node claims it.
	require.NoError(t, a.Release(ctx, "e1"))
	mustServe(t, b, "e1", Request{Register: true, Local: true, SpecNode: "gpu-1"})
	// Not an engine id: refused before the bucket sees it.
	for _, bad := range []string{"", "a.b", "_node", "a*", "a>"} {
		_, err = b.Resolve(ctx, bad, Request{Register: true, Local: true})
		require.ErrorIs(t, err, ErrBadEngine, "%q", bad)
	}
	// A released claim is no longer kept alive.
	_, err = a.KeepAlive(ctx, "e1")
	require.ErrorIs(t, err, ErrNotMine)
}

// Buckets are shared: a node with another lease or replica count is
// refused, not silently given the first node's, and told which setting
// differs from the bucket's, as a configuration error (ErrConfig: serve
// exits 2), not as a JetStream failure.
func TestOpenOwnersRefusesAnotherLease(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	openOwners(t, nc, "gpu-0", "", 1)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = OpenOwners(ctxT(t), js, Config{Node: "gpu-1", Boot: "b", Lease: 2 * testLease}, nil)
	require.Error(t, err)
	require.True(t, errors.Is(err, jetstream.ErrBucketExists), "%v", err)
	require.ErrorIs(t, err, ErrConfig)
	require.EqualError(t, err, fmt.Sprintf("cluster: bad config: ownership bucket kvactors_owners exists with "+
		"lease %v, not this node's %v (--lease): every node of a cluster takes the bucket's (docs/CLUSTER.md)",
		testLease, 2*testLease))
}

// A bucket that differs in a setting OpenOwners does not compare (made by
// hand, with a description) is a config error all the same.
func TestOpenOwnersRefusesABucketMadeOtherwise(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.CreateKeyValue(ctxT(t), jetstream.KeyValueConfig{Bucket: "kvactors_owners", Description: "by hand",
		History: 1, TTL: testLease, LimitMarkerTTL: testLease, Storage: jetstream.FileStorage, Replicas: 1})
	require.NoError(t, err)
	_, err = OpenOwners(ctxT(t), js, Config{Node: "gpu-1", Boot: "b", Lease: testLease}, nil)
	require.True(t, errors.Is(err, jetstream.ErrBucketExists), "%v", err)
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorContains(t, err, "other settings")
}

// statusUnreadable is a JetStream in which the ownership bucket exists with
// other settings (CreateKeyValue refuses it) and its status cannot be read.
type statusUnreadable struct {
	jetstream.JetStream
	err error
}

func (statusUnreadable) CreateKeyValue(context.Context, jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	return nil, jetstream.ErrBucketExists
}

func (s statusUnreadable) KeyValue(context.Context, string) (jetstream.KeyValue, error) {
	return nil, s.err
}

// A bucket refused as existing whose status then cannot be read is
// refused saying so, with the read's error (errors.Is finds it), not as a
// bucket "made by another kvactors version, or by hand": nothing was read
// to say that.
func TestOpenOwnersSaysWhenTheBucketsStatusCannotBeRead(t *testing.T) {
	t.Parallel()
	_, err := OpenOwners(ctxT(t), statusUnreadable{err: context.DeadlineExceeded},
		Config{Node: "gpu-1", Boot: "b", Lease: testLease}, nil)
	require.ErrorIs(t, err, ErrConfig)
	require.ErrorIs(t, err, jetstream.ErrBucketExists)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.EqualError(t, err, "cluster: bad config: ownership bucket kvactors_owners exists with other settings "+
		"than this node asks for, and its status could not be read to say which (ownership bucket kvactors_owners: "+
		"context deadline exceeded): every node of a cluster takes the bucket's (docs/CLUSTER.md)")
}

// The same for another replica count (a 3-server NATS cluster: one server
// refuses replicas 3 outright).
func TestOpenOwnersRefusesAnotherReplicaCount(t *testing.T) {
	t.Parallel()
	c := testkit.NATSCluster(t, 3)
	openOwners(t, c.Connect(0), "gpu-0", "", 3)
	js, err := jetstream.New(c.Connect(1))
	require.NoError(t, err)
	_, err = OpenOwners(ctxT(t), js, Config{Node: "gpu-1", Boot: "b", Lease: testLease, Replicas: 1}, nil)
	require.ErrorIs(t, err, ErrConfig)
	require.EqualError(t, err, "cluster: bad config: ownership bucket kvactors_owners exists with replicas 3, "+
		"not this node's 1 (--cluster-replicas): every node of a cluster takes the bucket's (docs/CLUSTER.md)")
}

// A keep-alive whose write committed but whose reply was lost leaves the
// node one revision behind: the next keep-alive sees its own record at the
// newer revision and carries on (not fenced). A record of anyone else
// fences it.
func TestKeepAliveAdoptsItsOwnLostWriteButNotAnothers(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	a := openOwners(t, nc, "gpu-0", "", 1)
	ctx := ctxT(t)
	_, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	kv := ownersBucket(t, nc)
	write := func(id ownership.Identity) uint64 {
		cur := eventuallyOwner(t, a, "e1", "")
		rev, err := kv.Update(ctx, "e1", ownership.EncodeRecord(ownership.Record{Identity: id, LeaseMS: 1000}), cur.Revision)
		require.NoError(t, err)
		return rev
	}

	lost := write(ownership.Identity{Node: "gpu-0", Boot: "gpu-0-boot1"}) // a's own write, reply lost
	rev, err := a.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	require.Greater(t, rev, lost)
	require.True(t, a.Serving("e1", time.Now()))

	write(ownership.Identity{Node: "gpu-0", Boot: "gpu-0-boot0"}) // the same node's previous process: not a's
	_, err = a.KeepAlive(ctx, "e1")
	require.ErrorIs(t, err, ErrFenced)
	require.False(t, a.Serving("e1", time.Now()))
}

// A keep-alive racing a release (unregister while the keep-alive loop runs)
// never brings the claim back nor reports it fenced: whichever write lands
// first, the engine ends unowned by this node, with no record left naming it.
func TestKeepAliveRacingReleaseLeavesTheEngineReleased(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	a := openOwners(t, nc, "gpu-0", "", 1)
	raceKeepAlive(t, a, ownersBucket(t, nc), "e", 40, a.Release, func(rec ownership.Record) bool {
		return rec.Identity.Node != "gpu-0" // no record still names the releasing node
	})
}

// raceKeepAlive claims rounds engines (prefix0, prefix1, …) on o, one at a
// time, and races each one's keep-alive with giveUp (Release, Leave): the
// keep-alive is never reported fenced, the engine ends out of o's claims,
// and its record is gone or one left accepts; no fence is counted.
func raceKeepAlive(t *testing.T, o *Owners, kv jetstream.KeyValue, prefix string, rounds int,
	giveUp func(context.Context, string) error, left func(ownership.Record) bool) {
	t.Helper()
	ctx := ctxT(t)
	for i := range rounds {
		engine := fmt.Sprintf("%s%d", prefix, i)
		mustServe(t, o, engine, Request{Register: true, Local: true})
		require.Contains(t, o.Mine(), engine)
		start := make(chan struct{})
		var wg sync.WaitGroup
		var kaErr error
		wg.Go(func() { <-start; _, kaErr = o.KeepAlive(ctx, engine) })
		wg.Go(func() { <-start; _ = giveUp(ctx, engine) })
		close(start)
		wg.Wait()
		require.False(t, errors.Is(kaErr, ErrFenced), "round %d: an engine given up is not fenced: %v", i, kaErr)
		require.NotContains(t, o.Mine(), engine, "round %d: giving it up stands", i)
		got, err := kv.Get(ctx, engine)
		if err == nil {
			rec, derr := ownership.DecodeRecord(got.Value())
			require.NoError(t, derr)
			require.True(t, left(rec), "round %d: the record left: %+v", i, rec)
		} else {
			require.True(t, isGone(err), "round %d: %v", i, err)
		}
	}
	require.Zero(t, testutil.ToFloat64(o.metrics.Fenced), "no giving up was counted as a fence")
}

// The keep-alive's write landing after a release took the engine out of
// this node's claims (the ordering the racing test above rarely hits): the
// keep-alive reports ErrNotMine, does not bring the claim back, and deletes
// the record it just wrote.
func TestKeepAliveWriteAfterReleaseUndoesItself(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	a := openOwners(t, nc, "gpu-0", "", 1)
	ctx := ctxT(t)
	kv := ownersBucket(t, nc)
	_, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	a.mu.Lock()
	rev := a.mine["e1"].rev
	delete(a.mine, "e1") // the release's first half; its delete of the record has not run
	a.mu.Unlock()

	err = a.claim(ctx, "e1", rev, true)
	require.ErrorIs(t, err, ErrNotMine)
	require.NotContains(t, a.Mine(), "e1", "the keep-alive did not bring the claim back")
	_, err = kv.Get(ctx, "e1")
	require.True(t, isGone(err), "the record the keep-alive wrote is gone: %v", err)
}

// mustServe resolves req for engine on o and requires the decision Serve.
func mustServe(t *testing.T, o *Owners, engine string, req Request) {
	t.Helper()
	d, err := o.Resolve(ctxT(t), engine, req)
	require.NoError(t, err)
	require.Equal(t, ownership.Serve, d.Action, "%s on %s: %s", engine, o.me.Node, d.Reason)
}

// A graceful shutdown's Leave replaces each record with a closed marker
// naming the closing boot: the node's next boot lists it as its previous
// boot's (PastBoots) and takes the engine back by CAS at its register;
// another node claims it at once, as it would a deleted record. A
// keep-alive racing Leave neither brings the claim back nor is counted as a
// fence, and leaves no live record naming the closing boot.
func TestLeaveLeavesAMarkerTheNextBootFindsAndOthersClaim(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	a := openOwners(t, nc, "gpu-0", "", 1)
	b := openOwners(t, nc, "gpu-1", "", 1)
	ctx := ctxT(t)
	kv := ownersBucket(t, nc)
	for _, e := range []string{"e1", "e2"} {
		mustServe(t, a, e, Request{Register: true, Local: true})
		require.NoError(t, a.Leave(ctx, e))
		got, err := kv.Get(ctx, e)
		require.NoError(t, err)
		rec, err := ownership.DecodeRecord(got.Value())
		require.NoError(t, err)
		require.Equal(t, ownership.Identity{Node: "gpu-0", Boot: "gpu-0-boot1"}, rec.Identity)
		require.True(t, rec.Closed, "%s's record is a closed marker", e)
	}
	require.Empty(t, a.Mine())

	js, err := jetstream.New(nc)
	require.NoError(t, err)
	a2, err := OpenOwners(ctx, js, Config{Node: "gpu-0", Boot: "gpu-0-boot2", Lease: testLease, Replicas: 1}, nil)
	require.NoError(t, err)
	past, err := a2.PastBoots(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"e1", "e2"}, past, "the next boot finds its previous boot's engines")
	d, err := a2.Resolve(ctx, "e1", Request{Register: true, Local: true, SpecNode: "gpu-0"})
	require.NoError(t, err)
	require.Equal(t, ownership.Serve, d.Action)
	require.Equal(t, "previous boot gpu-0-boot1", d.Reason)
	d, err = b.Resolve(ctx, "e2", Request{Register: true, Local: true})
	require.NoError(t, err)
	require.Equal(t, ownership.Serve, d.Action, "another node claims a closed marker at once: %s", d.Reason)

	raceKeepAlive(t, a2, kv, "r", 20, a2.Leave, func(rec ownership.Record) bool {
		return rec.Closed // no live record names the closing boot
	})
}

// A keep-alive whose write was sent before Leave's marker landed is refused
// on the marker's revision: the marker, naming this very boot, is no write
// of the claim to carry on from, so the keep-alive reports ErrNotMine and
// leaves the marker for the next boot (taken for a lost write of its own,
// it was overwritten and deleted).
func TestAKeepAliveAfterLeaveKeepsTheMarker(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	a := openOwners(t, nc, "gpu-0", "", 1)
	ctx := ctxT(t)
	kv := ownersBucket(t, nc)
	mustServe(t, a, "e1", Request{Register: true, Local: true})
	rev := a.Revision("e1")
	require.NoError(t, a.Leave(ctx, "e1"))

	err := a.claim(ctx, "e1", rev, true) // the keep-alive's write, on the revision before the marker
	require.ErrorIs(t, err, ErrNotMine)
	require.Empty(t, a.Mine())
	got, err := kv.Get(ctx, "e1")
	require.NoError(t, err, "the marker is still there")
	rec, err := ownership.DecodeRecord(got.Value())
	require.NoError(t, err)
	require.True(t, rec.Closed, "the record is still the closed marker: %+v", rec)
}
