package ownership

import (
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var (
	t0    = time.Unix(1_000_000, 0)
	lease = 10 * time.Second
	me    = Identity{Node: "gpu-1", Boot: "b2"}
)

func entry(node, boot string, rev uint64) *Entry {
	return &Entry{Record: Record{Identity: Identity{Node: node, Boot: boot}, LeaseMS: lease.Milliseconds()}, Revision: rev}
}

// closed is the marker a node leaves as it shuts down (cluster.Owners.Leave).
func closed(node, boot string, rev uint64) *Entry {
	e := entry(node, boot, rev)
	e.Closed = true
	return e
}

// Each case cites the PROTOCOL.md Clusters rule it checks.
func TestDecide(t *testing.T) {
	fresh := t0.Add(-lease / 2)
	stale := t0.Add(-lease)
	cases := []struct {
		name string
		in   Input
		want Decision
	}{
		// "a register naming no node is answered by exactly one node (the one whose compare-and-set won)"
		{"unowned register naming no node: create", Input{Register: true, Local: true}, Decision{Action: Claim, Owner: "gpu-1", Reason: "unowned"}},
		{"unowned register naming me: create", Input{Register: true, Local: true, SpecNode: "gpu-1"}, Decision{Action: Claim, Owner: "gpu-1", Reason: "unowned"}},
		{"unowned register, memory not here: ignore", Input{Register: true, Local: false}, Decision{Action: Ignore, Reason: "engine memory not on this host"}},
		{"unowned register naming another node: ignore", Input{Register: true, Local: true, SpecNode: "gpu-2"}, Decision{Action: Ignore, Reason: "names node gpu-2"}},
		{"unowned events: ignore until a register", Input{Local: true}, Decision{Action: Ignore, Reason: "no owner"}},
		// "When the owner's lease lapses, another node (the named one, or a standby on the same host) may take the engine over"
		{"standby, named node gone: create", Input{Register: true, Local: true, SpecNode: "gpu-0", StandbyFor: "gpu-0"}, Decision{Action: Claim, Owner: "gpu-1", Reason: "standby for gpu-0"}},
		{"standby, named node live: ignore", Input{Register: true, Local: true, SpecNode: "gpu-0", StandbyFor: "gpu-0", NamedLive: true}, Decision{Action: Ignore, Reason: "named node gpu-0 is live"}},
		// docs/CLUSTER.md "Deployment": a standby holds no engine while the node it stands by for is alive
		{"standby, unnamed engine, its primary live: ignore", Input{Register: true, Local: true, StandbyFor: "gpu-0", StandbyForLive: true}, Decision{Action: Ignore, Reason: "standby: gpu-0 is live"}},
		{"standby, unnamed engine, its primary gone: create", Input{Register: true, Local: true, StandbyFor: "gpu-0"}, Decision{Action: Claim, Owner: "gpu-1", Reason: "unowned"}},
		{"standby, engine naming it, its primary live: create", Input{Register: true, Local: true, SpecNode: "gpu-1", StandbyFor: "gpu-0", StandbyForLive: true}, Decision{Action: Claim, Owner: "gpu-1", Reason: "unowned"}},
		// "Only the owner answers or applies an engine's messages ... every other node stays silent"
		{"owned by another node: ignore register", Input{Entry: entry("gpu-0", "b0", 7), Register: true, Local: true}, Decision{Action: Ignore, Owner: "gpu-0", Reason: "owned by gpu-0"}},
		{"owned by another node: ignore events", Input{Entry: entry("gpu-0", "b0", 7), Local: true}, Decision{Action: Ignore, Owner: "gpu-0", Reason: "owned by gpu-0"}},
		{"owned by another node, standby: ignore while its lease holds", Input{Entry: entry("gpu-0", "b0", 7), Register: true, Local: true, StandbyFor: "gpu-0", SpecNode: "gpu-0"}, Decision{Action: Ignore, Owner: "gpu-0", Reason: "owned by gpu-0"}},
		{"mine, lease current: serve events", Input{Entry: entry("gpu-1", "b2", 7), Renewed: fresh}, Decision{Action: Serve, Owner: "gpu-1"}},
		{"mine, lease current: serve register naming me", Input{Entry: entry("gpu-1", "b2", 7), Renewed: fresh, Register: true, Local: true, SpecNode: "gpu-1"}, Decision{Action: Serve, Owner: "gpu-1"}},
		{"mine as standby: serve register naming the node I stand by for", Input{Entry: entry("gpu-1", "b2", 7), Renewed: fresh, Register: true, Local: true, SpecNode: "gpu-0", StandbyFor: "gpu-0"}, Decision{Action: Serve, Owner: "gpu-1"}},
		// "a register naming another node than the live owner is refused by the owner with an error naming itself"
		{"mine, register names another node: refuse", Input{Entry: entry("gpu-1", "b2", 7), Renewed: fresh, Register: true, Local: true, SpecNode: "gpu-5"}, Decision{Action: Refuse, Owner: "gpu-1", Reason: "names node gpu-5"}},
		// Fencing: a node stops serving once its own lease may have lapsed.
		{"mine, lease lapsed: ignore events", Input{Entry: entry("gpu-1", "b2", 7), Renewed: stale}, Decision{Action: Ignore, Owner: "gpu-1", Reason: "own lease lapsed"}},
		{"mine, never renewed: ignore events", Input{Entry: entry("gpu-1", "b2", 7)}, Decision{Action: Ignore, Owner: "gpu-1", Reason: "own lease lapsed"}},
		{"mine, lease lapsed, register: renew by CAS", Input{Entry: entry("gpu-1", "b2", 7), Renewed: stale, Register: true, Local: true}, Decision{Action: Claim, Owner: "gpu-1", Revision: 7, Reason: "own lease lapsed"}},
		{"my previous boot: take back by CAS on its revision", Input{Entry: entry("gpu-1", "b1", 9), Register: true, Local: true}, Decision{Action: Claim, Owner: "gpu-1", Revision: 9, Reason: "previous boot b1"}},
		{"my previous boot, events: ignore", Input{Entry: entry("gpu-1", "b1", 9), Local: true}, Decision{Action: Ignore, Owner: "gpu-1", Reason: "owned by a previous boot"}},
		{"my previous boot, register names another node: ignore", Input{Entry: entry("gpu-1", "b1", 9), Register: true, Local: true, SpecNode: "gpu-4"}, Decision{Action: Ignore, Owner: "gpu-1", Reason: "owned by a previous boot"}},
		// docs/CLUSTER.md "Close": a node shut down leaves a closed marker, no owner to any other node, its previous boot to its own next one
		{"closed by another node: register claims by CAS on the marker", Input{Entry: closed("gpu-0", "b0", 7), Register: true, Local: true}, Decision{Action: Claim, Owner: "gpu-1", Revision: 7, Reason: "unowned"}},
		{"closed by another node: events ignored", Input{Entry: closed("gpu-0", "b0", 7), Local: true}, Decision{Action: Ignore, Reason: "no owner"}},
		{"closed by another node, register names it: ignore", Input{Entry: closed("gpu-0", "b0", 7), Register: true, Local: true, SpecNode: "gpu-0"}, Decision{Action: Ignore, Reason: "names node gpu-0"}},
		{"closed by the node I stand by for, gone: claim by CAS", Input{Entry: closed("gpu-0", "b0", 7), Register: true, Local: true, SpecNode: "gpu-0", StandbyFor: "gpu-0"}, Decision{Action: Claim, Owner: "gpu-1", Revision: 7, Reason: "standby for gpu-0"}},
		{"closed by the node I stand by for, live: ignore", Input{Entry: closed("gpu-0", "b0", 7), Register: true, Local: true, SpecNode: "gpu-0", StandbyFor: "gpu-0", NamedLive: true}, Decision{Action: Ignore, Reason: "named node gpu-0 is live"}},
		{"closed by my previous boot: take back by CAS on its revision", Input{Entry: closed("gpu-1", "b1", 9), Register: true, Local: true}, Decision{Action: Claim, Owner: "gpu-1", Revision: 9, Reason: "previous boot b1"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := tc.in
			in.Me, in.Lease, in.Now = me, lease, t0
			require.Equal(t, tc.want, Decide(in))
		})
	}
}

// The owner stops serving Skew before a lease from its last write sent: a
// server whose clock runs ahead of the one that stamped the record (a new
// leader, a step, a slew) expires it that much early.
func TestDecideStopsServingTheSkewBeforeTheLease(t *testing.T) {
	skew := lease / 10
	mine := entry("gpu-1", "b2", 7)
	at := func(renewed time.Time, reg bool) Decision {
		return Decide(Input{Entry: mine, Me: me, Renewed: renewed, Register: reg, Local: true, Lease: lease, Skew: skew, Now: t0})
	}
	require.Equal(t, Serve, at(t0.Add(-(lease-2*skew)), false).Action, "well within the lease less the skew")
	require.Equal(t, Decision{Action: Ignore, Owner: "gpu-1", Reason: "own lease lapsed"}, at(t0.Add(-(lease-skew/2)), false),
		"within the lease, past it less the skew")
	require.Equal(t, Decision{Action: Claim, Owner: "gpu-1", Revision: 7, Reason: "own lease lapsed"}, at(t0.Add(-(lease-skew/2)), true),
		"a register then renews by compare-and-set")
}

// Whatever the input, at most the node named in the record serves, and a
// node that does not hold the record never serves or refuses.
func TestDecideNeverServesAnotherNodesEngine(t *testing.T) {
	for _, e := range []*Entry{nil, entry("gpu-0", "b0", 1), entry("gpu-1", "b1", 2), entry("gpu-1", "b2", 3)} {
		for _, reg := range []bool{false, true} {
			for _, spec := range []string{"", "gpu-0", "gpu-1", "gpu-9"} {
				for _, renewed := range []time.Time{{}, t0.Add(-time.Second), t0.Add(-lease)} {
					d := Decide(Input{Entry: e, Me: me, StandbyFor: "gpu-0", Register: reg, SpecNode: spec, Local: true, Renewed: renewed, Lease: lease, Now: t0})
					mine := e != nil && e.Identity == me
					if d.Action == Serve || d.Action == Refuse {
						require.True(t, mine, "%v for entry %+v", d, e)
					}
					if d.Action == Claim {
						require.True(t, reg, "a claim outside register: %+v", d)
						if e != nil {
							require.Equal(t, e.Revision, d.Revision, "a claim over an entry must CAS on its revision")
						}
					}
				}
			}
		}
	}
}

func TestRecordRoundTripAndRefusesEmptyOwner(t *testing.T) {
	r := Record{Identity: me, LeaseMS: 10_000, Renewed: 42}
	got, err := DecodeRecord(EncodeRecord(r))
	require.NoError(t, err)
	require.Equal(t, r, got)
	for _, bad := range []string{``, `{`, `{"node":"a"}`, `{"boot":"b"}`, `[]`} {
		_, err := DecodeRecord([]byte(bad))
		require.ErrorIs(t, err, ErrBadRecord, "%q", bad)
	}
}

func TestActionString(t *testing.T) {
	require.Equal(t, "claim", Claim.String())
	require.Equal(t, "Action(9)", Action(9).String())
}

// The core stays pure: standard library only.
func TestImportsOnlyTheStandardLibrary(t *testing.T) {
	requireStdOnly(t, ".")
}

func requireStdOnly(t *testing.T, pkg string) {
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg).Output()
	require.NoError(t, err)
	for _, dep := range strings.Fields(string(out)) {
		require.True(t, strings.HasPrefix(dep, "github.com/kvactors/kvactors/cluster/ownership"), "imports %s", dep)
	}
}

// Any bucket value: a record with an owner, or ErrBadRecord.
func FuzzDecodeRecord(f *testing.F) {
	f.Add([]byte(`{"node":"a","boot":"b","lease_ms":1000}`))
	f.Add([]byte(`{"node":""}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRecord(b)
		if err != nil {
			require.ErrorIs(t, err, ErrBadRecord)
			return
		}
		require.NotEmpty(t, r.Node)
		require.NotEmpty(t, r.Boot)
	})
}
