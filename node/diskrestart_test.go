package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// diskRouter is a router that follows nodes' kv_events across a restart and
// clears per medium: the contract's AllBlocksCleared (medium CPU) leaves
// what it believes of the disk tier alone. disk is what it believes each
// namespace holds on disk, by hash; logs is every event, per connection
// followed and engine, in order.
type diskRouter struct {
	mu   sync.Mutex
	disk map[string]map[string]bool
	logs map[string][]messages.KVEvent // by "boot/engine"
	bad  error
}

func newDiskRouter() *diskRouter {
	return &diskRouter{disk: map[string]map[string]bool{}, logs: map[string][]messages.KVEvent{}}
}

// follow subscribes to every engine's kv_events on nc, logging them under
// boot.
func (r *diskRouter) follow(t *testing.T, nc *nats.Conn, boot string) {
	t.Helper()
	sub, err := nc.Subscribe("kvactors.*.kv_events", func(m *nats.Msg) {
		var b messages.KVEventBatch
		err := json.Unmarshal(m.Data, &b)
		r.mu.Lock()
		defer r.mu.Unlock()
		if err != nil {
			r.bad = fmt.Errorf("kv_events %q: %w", m.Data, err)
			return
		}
		engine := strings.TrimSuffix(strings.TrimPrefix(m.Subject, "kvactors."), ".kv_events")
		for _, ev := range b.Events {
			r.logs[boot+"/"+engine] = append(r.logs[boot+"/"+engine], ev)
			if ev.Medium != messages.MediumDisk {
				continue
			}
			if r.disk[ev.Namespace] == nil {
				r.disk[ev.Namespace] = map[string]bool{}
			}
			switch ev.Type {
			case messages.KVAllBlocksCleared:
				clear(r.disk[ev.Namespace])
			case messages.KVBlockStored:
				for _, h := range ev.BlockHashes {
					r.disk[ev.Namespace][h] = true
				}
			case messages.KVBlockRemoved:
				for _, h := range ev.BlockHashes {
					delete(r.disk[ev.Namespace], h)
				}
			}
		}
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())
}

// believes is what the router believes namespace ns holds on disk, sorted.
func (r *diskRouter) believes(ns string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var hs []string
	for h, held := range r.disk[ns] {
		if held {
			hs = append(hs, h)
		}
	}
	slices.Sort(hs)
	return hs
}

// log is the events seen so far on engine's kv_events in boot.
func (r *diskRouter) log(boot, engine string) ([]messages.KVEvent, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.logs[boot+"/"+engine]), r.bad
}

// PROTOCOL.md "kv_events", restart: the contract's first message of an
// engine in a boot clears CPU only, so a router that clears per medium
// would keep the DISK beliefs of the last boot (here a record made bad on
// disk and a torn tail, both gone at rebuild) and never learn what this
// boot found on disk. The namespace's first engine in the boot gets, after
// the CPU clear, AllBlocksCleared DISK of its namespace and BlockStored
// DISK of exactly the chunks the node's lookups find on disk; another
// namespace's engine hears none of them, and a second engine of the
// namespace no second clear.
func TestARestartedNodeTellsRoutersWhatItsDiskHolds(t *testing.T) {
	t.Parallel()
	diskDir := t.TempDir()
	router := newDiskRouter()
	tenant := func(e *env, id, ns string) *testEngine {
		te := e.newEngine(id, defaultOpts())
		te.spec.Namespace = ns
		return te
	}
	store := func(te *testEngine, req string, hs ...string) {
		t.Helper()
		te.send(added(req, 8), hashesEv(req, 0, hs...), blocksEv(req, 0, 0, 1, 2), tokensEv(req, 8, 8))
		recv(t, te.stored, req+" stored")
	}
	var as, bs []string
	for i := range 4 {
		as, bs = append(as, hash("tnta", i)), append(bs, hash("tntb", i))
	}
	slices.Sort(as)
	slices.Sort(bs)

	// Boot 1: a pool of two chunks, so each pair stored evicts the one
	// before it to disk: all of as, then bs[:2].
	e := startNode(t, withPoolSlots(2), withDisk(diskDir))
	router.follow(t, e.nc, "1")
	ta, tb := tenant(e, "ta", "tenantA"), tenant(e, "tb", "tenantB")
	ta.register()
	tb.register()
	store(ta, "a01", as[0], as[1])
	store(ta, "a23", as[2], as[3])
	store(tb, "b01", bs[0], bs[1])
	store(tb, "b23", bs[2], bs[3])
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if got := router.believes("tenantA"); !slices.Equal(got, as) {
			return fmt.Errorf("the router believes tenantA's disk holds %v", got)
		}
		if got := router.believes("tenantB"); !slices.Equal(got, bs[:2]) {
			return fmt.Errorf("the router believes tenantB's disk holds %v", got)
		}
		return nil
	})
	where := func(h string) (string, int64) { // its record: disk keys end with the hash, then group 0
		t.Helper()
		for _, k := range e.node.Disk().Keys() {
			if strings.HasSuffix(string(k), string(mustHex(h))+"\x00\x00\x00\x00") {
				path, off, ok := e.node.Disk().Where(k)
				require.True(t, ok)
				return path, off
			}
		}
		t.Fatalf("%s is not on disk", h)
		return "", 0
	}
	badPath, badOff := where(as[3])
	tornPath, tornOff := where(bs[0])
	if p, off := where(bs[1]); off > tornOff {
		tornPath, tornOff = p, off
	}
	require.NoError(t, e.node.Close(context.Background()))
	flipByte(t, badPath, badOff+5)                       // fails its CRC: skipped at rebuild
	require.NoError(t, os.Truncate(tornPath, tornOff+3)) // the last record written, cut short: a torn tail

	// Boot 2 on the same directory.
	e2 := startNode(t, withPoolSlots(2), withDisk(diskDir))
	router.follow(t, e2.nc, "2")
	onDisk := func(te *testEngine, hs []string) []string {
		var found []string
		for _, h := range hs {
			if te.lookup([]string{h}) > 0 {
				found = append(found, h)
			}
		}
		return found
	}
	// told checks engine's kv_events of boot 2: the contract's CPU clear
	// first, then a DISK clear of ns, then BlockStored DISK of ns of
	// exactly want (and nothing else, once they are all there).
	told := func(engine, ns string, want []string) {
		t.Helper()
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			evs, err := router.log("2", engine)
			if err != nil {
				return err
			}
			if len(evs) < 2 {
				return fmt.Errorf("%s's kv_events: %+v", engine, evs)
			}
			require.Equal(t, messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: messages.MediumCPU}, evs[0],
				"the contract's message first")
			require.Equal(t, messages.KVEvent{Type: messages.KVAllBlocksCleared, Medium: messages.MediumDisk, Namespace: ns},
				evs[1], "then the namespace's DISK clear")
			var got []string
			for _, ev := range evs[2:] {
				require.Equal(t, messages.KVBlockStored, ev.Type, "%+v", ev)
				require.Equal(t, messages.MediumDisk, ev.Medium, "%+v", ev)
				require.Equal(t, ns, ev.Namespace, "%+v", ev)
				got = append(got, ev.BlockHashes...)
			}
			if slices.Sort(got); !slices.Equal(got, want) {
				return fmt.Errorf("%s was told of %v on disk, the lookups find %v", engine, got, want)
			}
			return nil
		})
	}
	ta2 := tenant(e2, "ta", "tenantA")
	ta2.register()
	foundA := onDisk(ta2, as)
	require.Equal(t, as[:3], foundA, "as[3]'s record failed its CRC at rebuild")
	told("ta", "tenantA", foundA)

	tb2 := tenant(e2, "tb", "tenantB")
	tb2.register()
	foundB := onDisk(tb2, bs)
	require.Len(t, foundB, 1, "of bs[:2] on disk the one written last was torn")
	told("tb", "tenantB", foundB)
	require.Equal(t, foundA, router.believes("tenantA"), "the router's DISK beliefs are what the disk holds")
	require.Equal(t, foundB, router.believes("tenantB"))

	// A second engine of tenantA: its register clears nothing more. Its
	// store's BlockStored CPU is announced on it after anything its
	// register queued.
	tc2 := tenant(e2, "tc", "tenantA")
	tc2.register()
	hc := []string{hash("tntc", 0), hash("tntc", 1)}
	store(tc2, "c01", hc...)
	require.ElementsMatch(t, hc, recvKVHashes(t, tc2, messages.KVBlockStored, messages.MediumCPU, "tenantA", 2))
	// The router reads on a connection of its own: it may hear tc's events
	// after tc does (seen once under load: an empty log read here).
	var evs []messages.KVEvent
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() (err error) {
		if evs, err = router.log("2", "tc"); err != nil {
			return err
		}
		var stored []string
		for _, ev := range evs {
			if ev.Type == messages.KVBlockStored && ev.Medium == messages.MediumCPU {
				stored = append(stored, ev.BlockHashes...)
			}
		}
		if len(stored) < len(hc) {
			return fmt.Errorf("the router has heard %d of tc's %d stored chunks: %+v", len(stored), len(hc), evs)
		}
		return nil
	})
	for _, ev := range evs[1:] {
		require.NotEqual(t, messages.KVAllBlocksCleared, ev.Type, "one DISK clear per namespace per boot: %+v", evs)
	}

	// Nothing crossed tenants: ta heard nothing of tenantB, tb nothing of
	// tenantA.
	for engine, other := range map[string]string{"ta": "tenantB", "tb": "tenantA"} {
		evs, err := router.log("2", engine)
		require.NoError(t, err)
		for _, ev := range evs {
			require.NotEqual(t, other, ev.Namespace, "%s: %+v", engine, ev)
			for _, h := range ev.BlockHashes {
				if other == "tenantB" {
					require.NotContains(t, bs, h, "%s heard of tenantB's %s", engine, h)
				} else {
					require.NotContains(t, as, h, "%s heard of tenantA's %s", engine, h)
				}
			}
		}
	}
}
