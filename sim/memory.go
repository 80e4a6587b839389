package sim

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/messages"
)

// memory is the engine's device memory: one shm segment per group, each
// holding RegionsPerGroup regions of NumGPUBlocks blocks, region after
// region (vLLM keeps one tensor per layer).
type memory struct {
	cfg  *Config
	segs []*shm.Segment
	mem  [][]byte // per group: the segment's bytes
}

// newMemory creates the segments under cfg.ShmDir with names no other run
// uses (a random suffix), so two engines or two runs never collide.
func newMemory(cfg *Config) (*memory, error) {
	var suffix [4]byte
	_, _ = rand.Read(suffix[:]) // crypto/rand.Read never fails
	m := &memory{cfg: cfg}
	size := int64(cfg.RegionsPerGroup) * int64(cfg.NumGPUBlocks) * cfg.BlockBytes
	for g := range cfg.Groups {
		name := fmt.Sprintf("%s-kvactors-sim-%s-g%d", cfg.Engine, hex.EncodeToString(suffix[:]), g)
		seg, err := shm.Create(cfg.ShmDir, name, size)
		if err != nil {
			_ = m.remove()
			return nil, fmt.Errorf("sim: create segment of group %d: %w", g, err)
		}
		m.segs = append(m.segs, seg)
		m.mem = append(m.mem, seg.Bytes())
	}
	return m, nil
}

// remove unmaps and unlinks every segment.
func (m *memory) remove() error {
	var errs []error
	for _, s := range m.segs {
		errs = append(errs, s.Remove())
	}
	m.segs, m.mem = nil, nil
	return errors.Join(errs...)
}

// block is region r of GPU block b of group g.
func (m *memory) block(g, r int, b uint32) []byte {
	off := (int64(r)*int64(m.cfg.NumGPUBlocks) + int64(b)) * m.cfg.BlockBytes
	return m.mem[g][off : off+m.cfg.BlockBytes]
}

// spec is the EngineSpec that describes this memory.
func (m *memory) spec() messages.EngineSpec {
	c := m.cfg
	s := messages.EngineSpec{TokensPerHash: c.TokensPerHash, BlocksPerChunk: c.BlocksPerChunk,
		NumGPUBlocks: c.NumGPUBlocks, Namespace: c.Namespace}
	for g, gc := range c.Groups {
		s.Segments = append(s.Segments, m.segs[g].Spec())
		gs := messages.GroupSpec{Kind: gc.Kind, TokensPerBlock: gc.TokensPerBlock, SlidingWindow: gc.SlidingWindow}
		for r := range c.RegionsPerGroup {
			gs.Regions = append(gs.Regions, messages.Region{Segment: g,
				Offset: int64(r) * int64(c.NumGPUBlocks) * c.BlockBytes, BlockStride: c.BlockBytes,
				BlockBytes: c.BlockBytes})
		}
		s.Groups = append(s.Groups, gs)
	}
	return s
}

// allocator hands out the usable block ids of each group: 1 up to (not
// including) the verify blocks. Freed ids are reused last-freed first: if
// kvactors ever copied a block after `released`, it would read another
// request's pattern and the final check would catch it.
type allocator struct {
	free [][]uint32 // per group, a stack
}

func newAllocator(cfg *Config) *allocator {
	a := &allocator{free: make([][]uint32, len(cfg.Groups))}
	last := uint32(cfg.NumGPUBlocks - cfg.VerifyBlocks) // first verify block
	for g := range a.free {
		for b := last - 1; b >= 1; b-- {
			a.free[g] = append(a.free[g], b)
		}
	}
	return a
}

// take pops n ids of group g; the caller checked there are enough.
func (a *allocator) take(g, n int) []uint32 {
	f := a.free[g]
	ids := append([]uint32(nil), f[len(f)-n:]...)
	a.free[g] = f[:len(f)-n]
	return ids
}

// putLast returns ids of group g to be handed out after every other free
// one: a preempted request that resumes gets other blocks than those it gave
// up, so a copy of the old ones made after their release cannot read the
// same bytes the request writes again.
func (a *allocator) putLast(g int, ids []uint32) {
	var back []uint32
	for _, b := range ids {
		if b != 0 {
			back = append(back, b)
		}
	}
	a.free[g] = append(back, a.free[g]...)
}

// scribbleByte fills a released block: no pattern FillBlock writes is all
// one byte, so a copy of the block made after its release fails the check.
const scribbleByte = 0xA5

// put returns ids of group g; null ids are skipped.
func (a *allocator) put(g int, ids []uint32) {
	for _, b := range ids {
		if b != 0 {
			a.free[g] = append(a.free[g], b)
		}
	}
}

// verifyBlocks are the scratch block ids of every group.
func verifyBlocks(cfg *Config) []uint32 {
	ids := make([]uint32, cfg.VerifyBlocks)
	for i := range ids {
		ids[i] = uint32(cfg.NumGPUBlocks - cfg.VerifyBlocks + i)
	}
	return ids
}
