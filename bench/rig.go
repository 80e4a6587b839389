package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// rig is one in-process node plus its simulated engines' connections and
// segments, all torn down by close.
type rig struct {
	cfg     Config
	node    *node.Node
	reg     *prometheus.Registry
	prefix  string
	url     string
	applied counter
	batches counter
	conns   []*nats.Conn
	segs    []*shm.Segment
}

// startEventRig starts the event phases' node and registers one engine per
// id with the event geometry, returning their connections.
func startEventRig(ctx context.Context, cfg Config, ids []string) (*rig, []*nats.Conn, error) {
	r, err := startRig(ctx, cfg, eventPoolBytes)
	if err != nil {
		return nil, nil, err
	}
	conns := make([]*nats.Conn, len(ids))
	for i, id := range ids {
		if conns[i], _, err = r.engine(ctx, id, eventGeometry()); err != nil {
			r.close()
			return nil, nil, err
		}
	}
	return r, conns, nil
}

// randomPrefix is a subject prefix of its own for one run (kind names the
// run: kvbench_, kvbenchx_, kvbenchb_), so a shared NATS server's other
// traffic, or an earlier run's, is not involved.
func randomPrefix(kind string) string { return fmt.Sprintf("%s%08x", kind, rand.Uint32()) }

// startRig starts a node with a pool of poolBytes under a prefix of its own,
// so a shared --nats server's other traffic is not involved.
func startRig(ctx context.Context, cfg Config, poolBytes int64) (*rig, error) {
	r := &rig{cfg: cfg, reg: prometheus.NewRegistry(), prefix: randomPrefix("kvbench_")}
	n, err := node.Start(ctx, node.Config{NATSURL: cfg.NATSURL, NATSPort: -1, HTTPAddr: node.HTTPOff,
		ShmDir: cfg.ShmDir, Prefix: r.prefix, PoolBytes: poolBytes,
		Registry: r.reg, Log: cfg.Log})
	if err != nil {
		return nil, fmt.Errorf("start node: %w", err)
	}
	r.node, r.url = n, n.NATSURL()
	prefault(n.Arena().Bytes())
	if r.applied, err = fastCounter(r.reg, mApplied, "", ""); err == nil {
		r.batches, err = fastCounter(r.reg, mBatches, "", "")
	}
	if err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// prefault writes one byte per page of the pool arena before any engine
// registers (nothing is stored yet, so no content changes). The shm backend
// maps the arena lazily, so the first store into each page would take a
// page fault inside Attachment.Copy, a cost a long-running node pays once:
// the bench measures a resident pool.
func prefault(mem []byte) {
	page := os.Getpagesize()
	for i := 0; i < len(mem); i += page {
		mem[i] = 0
	}
}

func (r *rig) subject(engine, verb string) string { return r.prefix + "." + engine + "." + verb }

// connect opens one more NATS client connection (an engine's, or the raw
// baseline's subscriber), its reply inbox under _INBOX.<name>: the node
// answers an engine's requests only in its own inbox.
func (r *rig) connect(name string) (*nats.Conn, error) {
	nc, err := nats.Connect(r.url, nats.Name(name), nats.MaxReconnects(0),
		nats.CustomInboxPrefix(client.InboxPrefix(name)))
	if err != nil {
		return nil, fmt.Errorf("connect %s to %s: %w", name, r.url, err)
	}
	r.conns = append(r.conns, nc)
	return nc, nil
}

// engine creates the shm segment of engine id with geometry geo, writes
// every byte of it (a GPU's memory is resident; copies should not measure
// tmpfs page allocation), connects and registers it.
func (r *rig) engine(ctx context.Context, id string, geo geometry) (*nats.Conn, *shm.Segment, error) {
	seg, err := shm.Create(r.cfg.ShmDir, id+"-"+r.prefix, geo.segmentBytes())
	if err != nil {
		return nil, nil, err
	}
	r.segs = append(r.segs, seg)
	mem := seg.Bytes()
	for i := range mem {
		mem[i] = byte(i*7 + i>>12)
	}
	nc, err := r.connect(id)
	if err != nil {
		return nil, nil, err
	}
	body, err := json.Marshal(geo.spec(seg.Name()))
	if err != nil {
		return nil, nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, natsWait)
	defer cancel()
	msg, err := nc.RequestWithContext(rctx, r.subject(id, "register"), body)
	if err != nil {
		return nil, nil, fmt.Errorf("register %s: %w", id, err)
	}
	var reply messages.RegisterReply
	if err := json.Unmarshal(msg.Data, &reply); err != nil || !reply.OK {
		return nil, nil, fmt.Errorf("register %s refused: %s", id, msg.Data)
	}
	return nc, seg, nil
}

// natsWait bounds a register request or a flush: what nats.go's Request
// and Flush would wait, which ignore ctx.
const natsWait = 10 * time.Second

// flush is nc.Flush ended by ctx too: a first Ctrl-C while a server is slow
// to answer stops the run at once, not after natsWait.
func flush(ctx context.Context, nc *nats.Conn) error {
	ctx, cancel := context.WithTimeout(ctx, natsWait)
	defer cancel()
	return nc.FlushWithContext(ctx)
}

func (r *rig) close() {
	for _, nc := range r.conns {
		nc.Close()
	}
	if r.node != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_ = r.node.Close(ctx)
		cancel()
	}
	for _, s := range r.segs {
		_ = s.Remove()
	}
}

// stream is one engine's batches and where they go.
type stream struct {
	nc      *nats.Conn
	subject string
	batches []batch
}

// stallTimeout is how long a consumer may take no batch at all while the
// window is full before drive gives up on it.
const stallTimeout = 30 * time.Second

// drive publishes every stream's batches, one goroutine per stream, as
// fast as the consumer takes them: at most window batches may be published
// and not yet taken (taken() counts them).
func drive(ctx context.Context, streams []stream, taken func() uint64, window int) error {
	var (
		published atomic.Uint64
		wg        sync.WaitGroup
		errs      = make([]error, len(streams))
		base      = taken()
	)
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := &streams[i]
			for j := range s.batches {
				if j%16 == 0 {
					if err := waitWindow(ctx, &published, taken, base, uint64(window)); err != nil {
						errs[i] = err
						return
					}
				}
				if err := s.nc.Publish(s.subject, s.batches[j].body); err != nil {
					errs[i] = fmt.Errorf("publish %s: %w", s.subject, err)
					return
				}
				published.Add(1)
			}
			if err := flush(ctx, s.nc); err != nil {
				errs[i] = fmt.Errorf("flush %s: %w", s.subject, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// waitWindow blocks while the window is full.
func waitWindow(ctx context.Context, published *atomic.Uint64, taken func() uint64, base, window uint64) error {
	last, since := taken(), time.Now()
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		t := taken()
		if published.Load() < t-base+window {
			return nil
		}
		if t != last {
			last, since = t, time.Now()
		} else if time.Since(since) > stallTimeout {
			return fmt.Errorf("the consumer took no batch for %v (%d published, %d taken)",
				stallTimeout, published.Load(), t-base)
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// sink is where measure publishes and how it knows the consumer caught up.
type sink struct {
	conns    []*nats.Conn
	subjects []string
	taken    func() uint64   // batches taken, for flow control
	progress func() float64  // monotonic progress of the consumer
	worth    func(batch) int // what one batch adds to progress once handled
	what     string          // for timeouts: "the node to apply %d events"
}

// tally is what one measure call published and how long it took: wall
// time, and this process's CPU time (user + system, getrusage) over the same
// intervals. On a machine shared with other work, events per CPU second is
// the steadier figure: wall time then includes waiting for a core.
type tally struct {
	events, batches int
	secs, cpu       float64
}

func (t tally) perSec() float64    { return float64(t.events) / t.secs }
func (t tally) perCPUSec() float64 { return float64(t.events) / t.cpu }

// measure runs the consumer at saturation for at least d of timed work.
// It works in chunks: next() encodes each engine's next batches (untimed),
// then the chunk is published flow-controlled and timed until the consumer
// has handled all of it. Every batch is published, so a generator's state
// always matches what the consumer saw (a batch skipped at a deadline would
// leave holes in later blocks and hashes events).
func measure(ctx context.Context, cfg Config, s sink, next func() [][]batch, d time.Duration) (tally, error) {
	var t tally
	var elapsed time.Duration
	for n := 0; n == 0 || elapsed < d; n++ {
		chunk := next()
		streams := make([]stream, len(chunk))
		want := 0
		for i, bs := range chunk {
			streams[i] = stream{nc: s.conns[i], subject: s.subjects[i], batches: bs}
			for _, b := range bs {
				t.events += int(b.events)
				want += s.worth(b)
			}
			t.batches += len(bs)
		}
		base := s.progress()
		cpu0 := cpuSeconds()
		start := time.Now()
		if err := drive(ctx, streams, s.taken, cfg.Window); err != nil {
			return tally{}, err
		}
		if err := waitFor(ctx, fmt.Sprintf(s.what, want), 60*time.Second,
			func() bool { return s.progress()-base >= float64(want) }); err != nil {
			return tally{}, err
		}
		elapsed += time.Since(start)
		t.cpu += cpuSeconds() - cpu0
	}
	t.secs = elapsed.Seconds()
	return t, nil
}

// cpuSeconds is the CPU time this process has used, user plus system.
func cpuSeconds() float64 {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

// nodeSink publishes to the node's events subjects of engines ids on conns.
func (r *rig) nodeSink(ids []string, conns []*nats.Conn) sink {
	s := sink{conns: conns, taken: func() uint64 { return uint64(r.batches()) }, progress: r.applied,
		worth: func(b batch) int { return int(b.applied) }, what: "the node to apply %d events"}
	for _, id := range ids {
		s.subjects = append(s.subjects, r.subject(id, "events"))
	}
	return s
}

// chunkEvents is measure's chunk size for a phase of duration d: big enough
// that the pipeline filling and draining at chunk edges costs little, small
// enough to keep memory bounded and the overshoot past d short.
func chunkEvents(d time.Duration) int {
	return max(10_000, min(200_000, int(d.Seconds()*150_000)))
}

// waitFor polls until done() or the deadline, and says what it waited for.
func waitFor(ctx context.Context, what string, timeout time.Duration, done func() bool) error {
	deadline := time.Now().Add(timeout)
	for !done() {
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Microsecond)
	}
	return nil
}

// engineIDs are the simulated engines' ids.
func engineIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("e%d", i)
	}
	return ids
}

func progress(cfg Config, format string, a ...any) {
	fmt.Fprintf(cfg.Progress, "bench: "+strings.TrimSuffix(format, "\n")+"\n", a...)
}
