package node_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// kvByEngine follows a kv_events tap per engine and checks, on every
// message, that it tells its engine only of its own namespace's keys.
type kvByEngine struct {
	t     *testing.T
	tap   <-chan kvSeen
	owner map[string]string         // block hash → the engine whose (own) namespace stored it
	seen  map[string][]kvChangeSeen // per engine, since the last reset
}

type kvChangeSeen struct{ typ, medium, hash string } // hash "" for AllBlocksCleared

// until reads the tap until done holds, checking each message.
func (k *kvByEngine) until(what string, done func() bool) {
	k.t.Helper()
	for !done() {
		m := recv(k.t, k.tap, fmt.Sprintf("%s (told so far: %v)", what, k.seen))
		for _, ev := range m.events {
			require.Contains(k.t, []string{"", m.engine}, ev.Namespace,
				"kv_events on %s name namespace %q: %+v", m.engine, ev.Namespace, m.events)
			if ev.Type == messages.KVAllBlocksCleared {
				k.seen[m.engine] = append(k.seen[m.engine], kvChangeSeen{ev.Type, ev.Medium, ""})
			}
			for _, h := range ev.BlockHashes {
				require.Equal(k.t, k.owner[h], m.engine, "%s of %s's block %s told to %s: %+v",
					ev.Type, k.owner[h], h, m.engine, m.events)
				k.seen[m.engine] = append(k.seen[m.engine], kvChangeSeen{ev.Type, ev.Medium, h})
			}
		}
	}
}

// has reports whether engine was told all of changes since the last reset.
func (k *kvByEngine) has(engine string, changes ...kvChangeSeen) func() bool {
	return func() bool {
		for _, c := range changes {
			if !slices.Contains(k.seen[engine], c) {
				return false
			}
		}
		return true
	}
}

func allOf(fs ...func() bool) func() bool {
	return func() bool {
		for _, f := range fs {
			if !f() {
				return false
			}
		}
		return true
	}
}

// PROTOCOL.md "Isolation" and "kv_events", reconnect: after a NATS
// reconnect the node clears what routers believe of every namespace and
// announces again every key it holds, in host memory and on disk. Each
// namespace's share goes only on its own engines' kv_events, as every
// change before it did: ta, tb and tc have their own namespaces in a pool
// of two slots with a disk tier; tb's and tc's stores evict ta's chunks
// (spilled to disk: the spilling engine is not the chunks'), tc leaves,
// and tb's next stores evict its own chunk, then tc's while tc's
// namespace has no member. Through the eviction, the spills, the outage and the
// re-announcement no kv_events message tells one engine another's hash or
// namespace; ta hears its chunks on disk again, tb its own (in memory
// and on disk), and tc, once it registers again, the clear and its chunk on disk.
func TestAReconnectReannouncesEachNamespaceOnlyToItsOwnEngines(t *testing.T) { // not parallel: an outage
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, strings.TrimPrefix(s.ClientURL(), "nats://"))
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	cfg := node.Config{NATSURL: "nats://" + link.Addr, ShmDir: dir, PoolBytes: 2 * 256, HTTPAddr: "off",
		Registry: reg, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		// Engines outlive the test's slowest step under -race: an expired
		// engine leaves its namespace, which this test does not mean.
		Lease:    60 * time.Second,
		FailStop: func(reason string) { t.Errorf("the node fail-stopped: %s", reason) }}
	withDisk(t.TempDir())(&cfg)
	n, err := node.Start(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	e := &env{t: t, node: n, reg: reg, dir: dir, nc: testkit.Connect(t, s)} // not through the link
	k := &kvByEngine{t: t, tap: kvTap(t, e), owner: map[string]string{}, seen: map[string][]kvChangeSeen{}}
	ta, tb, tc := e.newEngine("ta", defaultOpts()), e.newEngine("tb", defaultOpts()), e.newEngine("tc", defaultOpts())
	for _, te := range []*testEngine{ta, tb, tc} {
		te.register()
	}
	cpu, disk := messages.MediumCPU, messages.MediumDisk
	stored, removed, cleared := messages.KVBlockStored, messages.KVBlockRemoved, messages.KVAllBlocksCleared
	for _, req := range []string{"a1", "a2", "b1", "b2", "b3", "c1"} {
		k.owner[hash(req, 0)] = "t" + req[:1]
	}
	ch := func(typ, medium, req string) kvChangeSeen { return kvChangeSeen{typ, medium, hash(req, 0)} }

	ta.storeOne("a1", 1)
	ta.storeOne("a2", 2)
	tb.storeOne("b1", 1) // evicts a1 (spilled by tb)
	tc.storeOne("c1", 1) // evicts a2
	k.until("ta's chunks evicted and on disk", k.has("ta", ch(removed, cpu, "a1"), ch(stored, disk, "a1"),
		ch(removed, cpu, "a2"), ch(stored, disk, "a2")))
	var un messages.UnregisterReply
	require.NoError(t, jsonUnmarshal(tc.request("unregister", map[string]any{}), &un))
	require.True(t, un.OK, un.Error)
	tb.storeOne("b2", 2) // evicts b1
	tb.storeOne("b3", 3) // evicts c1: tc's namespace has no member
	k.until("b2 and b3 announced", k.has("tb", ch(stored, cpu, "b2"), ch(stored, cpu, "b3")))
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if got := len(n.Disk().Keys()); got != 4 {
			return fmt.Errorf("%d chunks on disk, want a1, a2, b1 and c1", got)
		}
		return nil
	})

	reconnects := e.counter("kvactors_nats_events_total", "reconnect")
	link.Cut()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if e.counter("kvactors_nats_events_total", "disconnect") == 0 {
			return errors.New("the node has not seen its connection drop")
		}
		return nil
	})
	link.Restore()
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		if e.counter("kvactors_nats_events_total", "reconnect") == reconnects {
			return errors.New("the node has not reconnected")
		}
		return nil
	})
	clear(k.seen)
	k.until("the re-announcement of ta's and tb's namespaces", allOf(
		k.has("ta", kvChangeSeen{cleared, cpu, ""}, kvChangeSeen{cleared, disk, ""},
			ch(stored, disk, "a1"), ch(stored, disk, "a2")),
		k.has("tb", kvChangeSeen{cleared, cpu, ""}, kvChangeSeen{cleared, disk, ""},
			ch(stored, disk, "b1"), ch(stored, cpu, "b2"), ch(stored, cpu, "b3"))))
	require.Empty(t, k.seen["tc"], "tc left: it hears nothing until it joins again")

	tc.register() // its namespace's clear and re-announcement were kept for it
	k.until("tc's namespace, on tc's return", k.has("tc", kvChangeSeen{cleared, cpu, ""},
		kvChangeSeen{cleared, disk, ""}, ch(stored, disk, "c1")))
	require.Equal(t, 4, tc.lookup([]string{hash("c1", 0)}), "tc's chunk, on disk, is its own")
	require.Zero(t, ta.lookup([]string{hash("c1", 0)}))
	require.Zero(t, tb.lookup([]string{hash("a1", 0)}))
}
