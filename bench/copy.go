package bench

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// Copy is the copy-bandwidth phase's result, one entry per block size.
type Copy struct {
	Sizes []CopySize `json:"sizes"`
}

// CopySize compares store jobs of copyBlocks blocks through the node's shm
// backend with a plain copy() of the same blocks between the same kinds of
// memory (the engine's shm segment into a resident host buffer), the two
// interleaved job by job. Rates are job bytes over the median job's time,
// which a busy machine's preemptions move less than totals.
type CopySize struct {
	BlockBytes int64 `json:"block_bytes"`
	JobBytes   int64 `json:"job_bytes"`
	Jobs       int   `json:"jobs"`
	// NodeGBps is per job kv_offload_total_bytes / kv_offload_total_time:
	// the transfer worker's Attachment.Copy call; NodeTotalGBps the same over
	// all jobs together.
	NodeGBps      float64 `json:"node_gbps"`
	NodeTotalGBps float64 `json:"node_total_gbps"`
	// EndToEndGBps is over publish → stored.
	EndToEndGBps  float64 `json:"end_to_end_gbps"`
	PlainGBps     float64 `json:"plain_copy_gbps"`
	Ratio         float64 `json:"ratio"`
	EndToEndRatio float64 `json:"end_to_end_ratio"`
	JobP50MS      float64 `json:"job_p50_ms"`
}

// copyBlocks is the blocks per store job: one request of that many chunks
// (blocks_per_chunk 1), like shm's BenchmarkCopy.
const copyBlocks = 16

// copySets is how many sets of copyBlocks blocks jobs rotate over: enough
// for 64 MiB, more than a CPU's last-level cache, so both the node and the
// plain copy() read cold memory, as a copy from a GPU would. The plain
// copy() of job j reads the set half a rotation away from the node's, so
// neither finds the other's source in cache.
func copySets(size int64) int {
	return max(3, int((64<<20)/(copyBlocks*size)))
}

func runCopy(ctx context.Context, cfg Config) (*Copy, error) {
	res := &Copy{}
	budget := cfg.Duration / time.Duration(len(cfg.CopySizes))
	for _, size := range cfg.CopySizes {
		cs, err := copySize(ctx, cfg, size, budget)
		if err != nil {
			return nil, fmt.Errorf("copy %d-byte blocks: %w", size, err)
		}
		res.Sizes = append(res.Sizes, *cs)
		progress(cfg, "copy %s blocks: node %.2f GB/s, end to end %.2f GB/s, copy() %.2f GB/s",
			sizeLabel(size), cs.NodeGBps, cs.EndToEndGBps, cs.PlainGBps)
	}
	return res, nil
}

// copyRig is a node with one engine whose blocks are size bytes, and the
// plain-copy baseline's buffers.
type copyRig struct {
	r      *rig
	nc     *nats.Conn
	size   int64
	tpb    int
	sets   int
	stored chan messages.Stored
	enc    encoder
	src    []byte // the engine's segment, as the engine maps it
	dst    []byte // a resident host buffer of the pool's size
}

const copySlots = 2 * copyBlocks // the pool holds two jobs; the third evicts

func newCopyRig(ctx context.Context, cfg Config, size int64) (*copyRig, error) {
	geo := geometry{tph: 16, tpb: 16, bpc: 1, kinds: []string{messages.KindFull}, blockBytes: size,
		numBlocks: 1 + copySets(size)*copyBlocks}
	r, err := startRig(ctx, cfg, copySlots*size)
	if err != nil {
		return nil, err
	}
	c := &copyRig{r: r, size: size, tpb: geo.tpb, sets: copySets(size), stored: make(chan messages.Stored, 4)}
	nc, seg, err := r.engine(ctx, "c0", geo)
	if err != nil {
		r.close()
		return nil, err
	}
	c.nc, c.src = nc, seg.Bytes()
	if _, err := nc.Subscribe(r.subject("c0", "stored"), func(m *nats.Msg) {
		if st, err := ingest.DecodeStored(m.Data); err == nil { // the SDK's decoder, as the latency phase's
			c.stored <- st
		}
	}); err != nil {
		r.close()
		return nil, err
	}
	if err := flush(ctx, nc); err != nil {
		r.close()
		return nil, err
	}
	c.dst = make([]byte, copySlots*size)
	for i := range c.dst {
		c.dst[i] = byte(i)
	}
	return c, nil
}

func (c *copyRig) close() { c.r.close() }

// job stores copyBlocks blocks as one request (added, hashes, blocks,
// tokens and finished in one batch) and returns publish → stored.
func (c *copyRig) job(ctx context.Context, j int) (time.Duration, error) {
	id := "copy-" + strconv.Itoa(j)
	tokens := copyBlocks * c.tpb
	c.enc.begin("bench-copy", uint64(j+1))
	c.enc.added(id, tokens)
	c.enc.hashes(id, 0, copyBlocks, func(i int, dst *[hashBytes]byte) { fillHash(uint64(j)<<8|0xc0, i, dst) })
	c.enc.blocks(id, 0, 0, copyIDs(j, c.sets))
	c.enc.tokens(id, tokens, tokens)
	c.enc.finished(id, false, tokens, tokens)
	b := c.enc.finish()
	start := time.Now()
	if err := c.nc.Publish(c.r.subject("c0", "events"), b.body); err != nil {
		return 0, err
	}
	select {
	case st := <-c.stored:
		if st.Request != id || st.Bytes != copyBlocks*c.size {
			return 0, fmt.Errorf("stored %s with %d bytes, want %s with %d", st.Request, st.Bytes, id, copyBlocks*c.size)
		}
		return time.Since(start), nil
	case <-time.After(10 * time.Second):
		return 0, fmt.Errorf("no stored message for job %d within 10s", j)
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// plain copies job j's blocks with copy(), into slots laid out as the
// pool's would be.
func (c *copyRig) plain(j int) time.Duration {
	size := c.size
	start := time.Now()
	for k, id := range copyIDs(j+c.sets/2, c.sets) {
		slot := int64((j%2)*copyBlocks + copyBlocks - 1 - k)
		copy(c.dst[slot*size:(slot+1)*size], c.src[int64(id)*size:int64(id+1)*size])
	}
	return time.Since(start)
}

// warmup is the untimed jobs before measuring: one rotation, so the
// node's own mapping of every block is faulted in (its pool arena is
// prefaulted at start).
func (c *copyRig) warmup(ctx context.Context) (int, error) {
	for j := range c.sets {
		if _, err := c.job(ctx, j); err != nil {
			return 0, err
		}
		c.plain(j)
	}
	return c.sets, nil
}

func copySize(ctx context.Context, cfg Config, size int64, budget time.Duration) (*CopySize, error) {
	c, err := newCopyRig(ctx, cfg, size)
	if err != nil {
		return nil, err
	}
	defer c.close()
	first, err := c.warmup(ctx)
	if err != nil {
		return nil, err
	}
	reg, dir := c.r.reg, backend.DeviceToHost.String()
	copyTime, err := fastCounter(reg, mCopyTime, "transfer_type", dir)
	if err != nil {
		return nil, err
	}
	bytes0, time0 := gatherSum(reg, mBytes, "transfer_type", dir), copyTime()
	var node, e2e, plain []time.Duration
	deadline := time.Now().Add(budget)
	for j := first; j < first+2000 && (j < first+5 || time.Now().Before(deadline)); j++ {
		before := copyTime()
		d, err := c.job(ctx, j)
		if err != nil {
			return nil, err
		}
		// The transfer actor adds the copy's time before the request actor
		// publishes stored, so the counter already holds this job's copy.
		node = append(node, time.Duration((copyTime()-before)*1e9))
		e2e = append(e2e, d)
		plain = append(plain, c.plain(j))
	}
	totalBytes := gatherSum(reg, mBytes, "transfer_type", dir) - bytes0
	totalTime := copyTime() - time0
	for _, ds := range [][]time.Duration{node, e2e, plain} {
		slices.Sort(ds)
	}
	job := float64(copyBlocks * size)
	gbps := func(sorted []time.Duration) float64 { return job / (pct(sorted, 0.5) / 1e3) / 1e9 }
	cs := &CopySize{BlockBytes: size, JobBytes: copyBlocks * size, Jobs: len(e2e), NodeGBps: gbps(node),
		EndToEndGBps: gbps(e2e), PlainGBps: gbps(plain), JobP50MS: pct(e2e, 0.5)}
	if totalTime > 0 {
		cs.NodeTotalGBps = totalBytes / totalTime / 1e9
	}
	cs.Ratio = cs.NodeGBps / cs.PlainGBps
	cs.EndToEndRatio = cs.EndToEndGBps / cs.PlainGBps
	return cs, nil
}

// copyIDs are job j's block ids: jobs rotate over sets of 16 blocks.
func copyIDs(j, sets int) []uint32 {
	ids := make([]uint32, copyBlocks)
	for k := range ids {
		ids[k] = uint32(1 + (j%sets)*copyBlocks + k)
	}
	return ids
}

func sizeLabel(b int64) string {
	if b >= 1<<20 && b%(1<<20) == 0 {
		return strconv.FormatInt(b>>20, 10) + " MiB"
	}
	return strconv.FormatInt(b>>10, 10) + " KiB"
}
