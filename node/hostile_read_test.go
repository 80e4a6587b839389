package node_test

import (
	"encoding/json"
	"slices"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/natsauth"
)

// The read side of the NATS permission attacks (docs/SECURITY.md, "NATS
// permissions"), under the configuration `kvactors nats-config` generates:
// engine mal, and router rt, try every way to learn what vic stores or to
// act on its pool in its name. Each subscription is refused, so mal hears
// none of vic's kv_events (its block hashes), stored (its keys) or resync
// messages, nor every engine's kv_events at once; each request in vic's
// name (lookup of its prefix, a load that would write its blocks,
// heartbeat, unregister) is refused, so the node never handles it. vic is
// untouched: its blocks, lookups and loads as before, still registered.
func TestHostileNATSCannotReadOrActOnAnotherEnginesPool(t *testing.T) {
	t.Parallel()
	base, connect := securedNode(t, natsauth.Options{Engines: []string{"vic", "mal"}, Routers: []string{"rt"},
		Auth: natsauth.AuthPassword, BcryptCost: bcrypt.MinCost})
	vicEnv, malEnv := *base, *base
	vicEnv.nc = connect("vic", make(chan error, 64))
	malErrs, rtErrs := make(chan error, 64), make(chan error, 64)
	malEnv.nc = connect("mal", malErrs)
	rt := connect("rt", rtErrs)
	vic, hs, want := victim(t, &vicEnv)
	mal := malEnv.newEngine("mal", defaultOpts())
	mal.register()

	// Eavesdropping: every subscription that would carry vic's hashes,
	// keys or replies is refused. A channel subscription takes a message
	// in the connection's read loop, so after the Flush below any message
	// the server had for it is in the channel.
	heard := make(chan *nats.Msg, 64)
	for _, subj := range []string{"kvactors.vic.kv_events", "kvactors.*.kv_events", "kvactors.vic.stored",
		"kvactors.vic.resync", "kvactors.vic.*", "kvactors.*.stored", "kvactors.>", ">"} {
		_, err := malEnv.nc.ChanSubscribe(subj, heard)
		require.NoError(t, err)
		require.NoError(t, malEnv.nc.Flush())
		violation(t, malErrs, subj)
	}
	for _, subj := range []string{"kvactors.vic.stored", "kvactors.vic.released", "kvactors.vic.resync", "_INBOX.vic.>"} {
		_, err := rt.ChanSubscribe(subj, heard)
		require.NoError(t, err)
		require.NoError(t, rt.Flush())
		violation(t, rtErrs, subj)
	}

	// Acting in vic's name: a lookup would tell mal which of vic's
	// prefixes are stored, a load would write vic's blocks 50..53, a
	// heartbeat or unregister would keep vic alive or end it. Each publish
	// is refused by the server (the violation is reported once the server
	// has taken it: it never reaches the node).
	for i := range 4 {
		vic.fill(0, messages.BlockID(50+i), 3)
	}
	sentinel := func() []byte {
		var b []byte
		for i := range 4 {
			b = append(b, vic.block(0, messages.BlockID(50+i))...)
		}
		return b
	}
	before := sentinel()
	bodies := map[string]any{
		"lookup":     map[string]any{"hashes": hs},
		"load":       map[string]any{"request": "steal", "hashes": hs, "num_tokens": 16, "blocks": [][]int{{50, 51, 52, 53}}},
		"heartbeat":  messages.HeartbeatRequest{Epoch: "ep1", Seq: 1},
		"unregister": map[string]any{},
	}
	for verb, body := range bodies {
		data, err := json.Marshal(body)
		require.NoError(t, err)
		for _, c := range []struct {
			nc   *nats.Conn
			errs chan error
			id   string
		}{{malEnv.nc, malErrs, "mal"}, {rt, rtErrs, "rt"}} {
			subj := "kvactors.vic." + verb
			require.NoError(t, c.nc.PublishRequest(subj, natsauth.InboxPrefix(c.id)+".x", data))
			require.NoError(t, c.nc.Flush())
			violation(t, c.errs, subj)
		}
	}

	// vic stores another chunk: its stored and kv_events go out while mal's
	// and rt's refused subscriptions stand, and reach vic alone.
	vic.fill(0, 44, 9)
	vic.send(added("r2", 4), hashesEv("r2", 0, hash("v2", 0)), blocksEv("r2", 0, 0, 44), tokensEv("r2", 4, 4))
	recv(t, vic.stored, "vic's second store")
	for seen := false; !seen; {
		seen = slices.Contains(recvKVHashes(t, vic, messages.KVBlockStored, messages.MediumCPU, "vic", 1), hash("v2", 0))
	}
	require.NoError(t, malEnv.nc.Flush())
	require.NoError(t, rt.Flush())
	require.Empty(t, heard, "a refused subscription delivered something of vic's")

	require.Equal(t, before, sentinel(), "no load in vic's name wrote its blocks")
	require.Empty(t, vic.heartbeat(vic.epoch, vic.seq).Error, "vic still registered: no unregister in its name")
	intact(t, vic, hs, want)
	require.Equal(t, 0, mal.lookup(hs), "mal's own lookup misses vic's prefix")
}
