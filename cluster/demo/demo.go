package demo

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/cluster/embedded"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// Options of a cluster demo run.
type Options struct {
	Nodes      int    // NATS servers and nodes, one node per server (default 3)
	Engines    int    // engines per node (default 2)
	Prefixes   int    // prefixes each engine stores (default 4)
	Chunks     int    // chunks per prefix (default 8)
	BlockBytes int64  // bytes per block = per chunk (default 64 KiB)
	ShmDir     string // where engines create their segments (default: a temp dir)
	Seed       uint64 // seed of the stored bytes (default 1)
	Log        *slog.Logger
}

func (o Options) withDefaults() Options {
	if o.Nodes == 0 {
		o.Nodes = 3
	}
	if o.Engines == 0 {
		o.Engines = 2
	}
	if o.Prefixes == 0 {
		o.Prefixes = 4
	}
	if o.Chunks == 0 {
		o.Chunks = 8
	}
	if o.BlockBytes == 0 {
		o.BlockBytes = 64 << 10
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	return o
}

const (
	namespace     = "demo"
	tokensPerHash = 16
	lease         = 2 * time.Second
)

// Result is what a run saw; Err is nil when every check passed.
type Result struct {
	Stored, Loads, LookupHits int
	RemoteChunks, Checked     int
	CheckedBytes              int64
	RemoteLoads, LocalLoads   []time.Duration // load round trips with and without remote chunks
	Nodes                     []cluster.NodeRow
}

// engine is one demo engine: a client session, its segment, and what it
// stored (prefix → block ids).
type engine struct {
	id, node string
	c        *client.Client
	nc       *nats.Conn
	seg      *shm.Segment
	stored   chan int
}

// Run starts the cluster, stores prefixes through every engine, then has
// every engine look up and load every prefix stored on the other nodes and
// checks each loaded byte against the bytes its source engine stored. It
// prints as it goes to w.
func Run(ctx context.Context, o Options, w io.Writer) (res Result, err error) {
	o = o.withDefaults()
	if o.Nodes < 2 {
		return res, fmt.Errorf("a cluster demo needs at least 2 nodes, got %d", o.Nodes)
	}
	tmp, err := os.MkdirTemp("", "kvactors-cluster-demo-")
	if err != nil {
		return res, err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	if o.ShmDir == "" {
		o.ShmDir = tmp
	}
	nc3, err := embedded.Start(embedded.Options{Servers: o.Nodes, Dir: tmp, Name: "kvactors-demo"})
	if err != nil {
		return res, fmt.Errorf("start the NATS cluster: %w", err)
	}
	defer nc3.Close()
	fctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = nc3.WaitFormed(fctx)
	cancel()
	if err != nil {
		return res, err
	}
	fmt.Fprintf(w, "NATS cluster: %d servers routed on loopback, JetStream on each\n", o.Nodes)

	var nodes []*node.Node
	defer func() {
		for _, n := range nodes {
			err = errors.Join(err, n.Close(context.Background()))
		}
	}()
	blocks := o.Prefixes*o.Chunks + o.Chunks + 1 // stored prefixes, one load target, block 0 unused
	pool := int64(o.Nodes*o.Engines*o.Prefixes*o.Chunks+o.Chunks) * o.BlockBytes
	for i := range o.Nodes {
		n, err := node.Start(ctx, node.Config{NATSURL: nc3.URLs(i), NodeID: fmt.Sprintf("node-%d", i+1),
			Cluster: true, ClusterReplicas: min(3, o.Nodes), Lease: lease, ShmDir: o.ShmDir, PoolBytes: pool,
			HTTPAddr: node.HTTPOff, Log: o.Log, Registry: prometheus.NewRegistry()})
		if err != nil {
			return res, fmt.Errorf("start node-%d: %w", i+1, err)
		}
		nodes = append(nodes, n)
	}
	if err := waitNodesSeen(ctx, nodes); err != nil {
		return res, err
	}

	var engines []*engine
	defer func() {
		for _, e := range engines {
			_ = e.c.Close()
			e.nc.Close()
			_ = e.seg.Remove()
		}
	}()
	for i, n := range nodes {
		var ids []string
		for k := range o.Engines {
			e, err := startEngine(ctx, nc3.URLs(i), n.NodeID(), fmt.Sprintf("%s-e%d", n.NodeID(), k+1), blocks, o)
			if err != nil {
				return res, err
			}
			engines = append(engines, e)
			ids = append(ids, e.id)
		}
		fmt.Fprintf(w, "%s (boot %s) on NATS server %d: engines %v\n", n.NodeID(), n.Boot(), i, ids)
	}

	// Every engine fills and stores its prefixes.
	rng := rand.New(rand.NewPCG(o.Seed, 0))
	for _, e := range engines {
		mem := e.seg.Bytes()
		for i := range mem[:int64(o.Prefixes*o.Chunks+1)*o.BlockBytes] {
			mem[i] = byte(rng.Uint32())
		}
		for p := range o.Prefixes {
			req := fmt.Sprintf("p%d", p)
			raw, _ := prefixHashes(e.id, p, o.Chunks)
			ids := make([]uint32, o.Chunks)
			for c := range ids {
				ids[c] = uint32(1 + p*o.Chunks + c)
			}
			toks := o.Chunks * tokensPerHash
			e.c.Added(req, toks)
			e.c.Hashes(req, 0, raw...)
			e.c.Blocks(req, 0, 0, ids)
			e.c.Tokens(req, toks, toks)
			e.c.Finished(req, false, toks, toks)
		}
		if err := e.c.Flush(); err != nil {
			return res, fmt.Errorf("engine %s: %w", e.id, err)
		}
	}
	want := o.Prefixes * o.Chunks
	for _, e := range engines {
		got := 0
		for got < want {
			select {
			case k := <-e.stored:
				got += k
			case <-time.After(20 * time.Second):
				return res, fmt.Errorf("engine %s: %d of %d chunks stored after 20s", e.id, got, want)
			case <-ctx.Done():
				return res, ctx.Err()
			}
		}
		res.Stored += got
	}
	fmt.Fprintf(w, "stored: %d engines × %d prefixes × %d chunks = %d chunks of %d KiB, each in its own node's pool\n",
		len(engines), o.Prefixes, o.Chunks, res.Stored, o.BlockBytes>>10)

	// Every engine loads every prefix stored on another node into its
	// target blocks and checks every byte.
	target := make([][]int64, 1)
	for c := range o.Chunks {
		target[0] = append(target[0], int64(1+o.Prefixes*o.Chunks+c))
	}
	toks := o.Chunks * tokensPerHash
	for _, dst := range engines {
		for _, src := range engines {
			if src.node == dst.node {
				continue
			}
			for p := range o.Prefixes {
				_, hx := prefixHashes(src.id, p, o.Chunks)
				if err := waitLookup(ctx, dst, hx, toks); err != nil {
					return res, err
				}
				res.LookupHits++
				start := time.Now()
				rep, err := load(dst, fmt.Sprintf("load-%s-p%d", src.id, p), hx, toks, target)
				if err != nil {
					return res, err
				}
				if took := time.Since(start); rep.RemoteChunks > 0 {
					res.RemoteLoads = append(res.RemoteLoads, took)
				} else {
					res.LocalLoads = append(res.LocalLoads, took)
				}
				res.Loads++
				res.RemoteChunks += rep.RemoteChunks
				for c := range o.Chunks {
					s := block(src, int64(1+p*o.Chunks+c), o.BlockBytes)
					d := block(dst, target[0][c], o.BlockBytes)
					if !bytes.Equal(s, d) {
						return res, fmt.Errorf("integrity: chunk %d of %s's prefix %d loaded on %s (%s) differs: crc32c %08x, stored %08x",
							c, src.id, p, dst.id, dst.node, cluster.CRC32C(d), cluster.CRC32C(s))
					}
					res.Checked++
					res.CheckedBytes += int64(len(d))
				}
			}
		}
	}
	fmt.Fprintf(w, "cross-node: %d lookups hit on every token, %d loads, %d chunks fetched from other nodes (remote_chunks)\n",
		res.LookupHits, res.Loads, res.RemoteChunks)
	fmt.Fprintf(w, "load round trip, %d chunks of %d KiB: fetched from another node %s; already in the local pool %s\n",
		o.Chunks, o.BlockBytes>>10, quantiles(res.RemoteLoads), quantiles(res.LocalLoads))
	fmt.Fprintf(w, "integrity: %d loaded chunks (%.1f MiB), every byte compared with what its engine stored on another node: OK\n",
		res.Checked, float64(res.CheckedBytes)/(1<<20))

	enc := engines[0].nc
	var table *cluster.OwnerTable
	if js, err := jetstream.New(enc); err == nil {
		if table, err = cluster.WatchBucket(ctx, js, cluster.DefaultConfig().Bucket); err == nil {
			defer table.Stop()
		}
	}
	rows, err := cluster.Survey(ctx, enc, node.DefaultConfig().Prefix, table, lease/2)
	if err != nil {
		return res, err
	}
	res.Nodes = rows
	fmt.Fprintln(w, "\nkvactors nodes:")
	if err := cluster.WriteNodes(w, rows); err != nil {
		return res, err
	}
	return res, nil
}

func startEngine(ctx context.Context, url, nodeID, id string, blocks int, o Options) (*engine, error) {
	seg, err := shm.Create(o.ShmDir, id+"-kvactors-demo", int64(blocks)*o.BlockBytes)
	if err != nil {
		return nil, fmt.Errorf("engine %s: %w", id, err)
	}
	nc, err := client.Dial(url, id)
	if err != nil {
		_ = seg.Remove()
		return nil, err
	}
	e := &engine{id: id, node: nodeID, nc: nc, seg: seg, stored: make(chan int, 1024)}
	spec := messages.EngineSpec{TokensPerHash: tokensPerHash, BlocksPerChunk: 1, NumGPUBlocks: blocks,
		Namespace: namespace, Node: nodeID, Segments: []messages.Segment{seg.Spec()},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: tokensPerHash,
			Regions: []messages.Region{{Segment: 0, BlockStride: o.BlockBytes, BlockBytes: o.BlockBytes}}}}}
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	e.c, err = client.Connect(rctx, nc, client.Config{Engine: id, Spec: spec, Log: o.Log,
		OnStored: func(s messages.Stored) { e.stored <- len(s.Chunks) }})
	if err != nil {
		nc.Close()
		_ = seg.Remove()
		return nil, err
	}
	if got := e.c.Stats().Node; got != nodeID {
		// Not in Run's engines: closed here (the Close unregisters it).
		_ = e.c.Close()
		nc.Close()
		_ = seg.Remove()
		return nil, fmt.Errorf("engine %s naming %s was registered by %s", id, nodeID, got)
	}
	return e, nil
}

func quantiles(ts []time.Duration) string {
	if len(ts) == 0 {
		return "(none)"
	}
	ts = slices.Clone(ts)
	slices.Sort(ts)
	return fmt.Sprintf("p50 %v p99 %v (%d loads)", ts[len(ts)/2].Round(10*time.Microsecond),
		ts[len(ts)*99/100].Round(10*time.Microsecond), len(ts))
}

func prefixHashes(engine string, p, chunks int) ([][]byte, []string) {
	raw := make([][]byte, chunks)
	hx := make([]string, chunks)
	for c := range chunks {
		raw[c] = []byte(fmt.Sprintf("%s/p%d/%d", engine, p, c))
		hx[c] = hex.EncodeToString(raw[c])
	}
	return raw, hx
}

func block(e *engine, id, size int64) []byte { return e.seg.Bytes()[id*size : (id+1)*size] }

// waitLookup waits until dst's node counts the prefix (its holders index
// learns other nodes' keys from their kv_events).
func waitLookup(ctx context.Context, dst *engine, hx []string, want int) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := dst.c.Lookup(ctx, hx)
		if err == nil && got == want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("engine %s: lookup counts %d of %d tokens after 10s (%v)", dst.id, got, want, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// load sends P.E.load itself: the reply's remote_chunks is what the demo
// shows.
func load(e *engine, req string, hx []string, toks int, blocks [][]int64) (messages.LoadReply, error) {
	body, _ := json.Marshal(messages.LoadRequest{Request: req, Hashes: hx, NumTokens: toks, Blocks: blocks})
	m, err := e.nc.Request(node.DefaultConfig().Prefix+"."+e.id+"."+messages.VerbLoad, body, 20*time.Second)
	if err != nil {
		return messages.LoadReply{}, fmt.Errorf("engine %s: load %s: %w", e.id, req, err)
	}
	var r messages.LoadReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return r, fmt.Errorf("engine %s: load %s: %w", e.id, req, err)
	}
	if !r.OK {
		return r, fmt.Errorf("engine %s: load %s: %s", e.id, req, r.Error)
	}
	return r, nil
}

func waitNodesSeen(ctx context.Context, nodes []*node.Node) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok := true
		for _, n := range nodes {
			live := 0
			for _, ni := range n.ClusterNodes() {
				if ni.Live {
					live++
				}
			}
			ok = ok && live >= len(nodes)-1
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("nodes did not hear each other within 20s")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
