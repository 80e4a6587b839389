package disk

import (
	"container/list"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// Config is the disk tier's settings.
type Config struct {
	// Dir holds one file per chunk; created if missing.
	Dir string
	// Bytes is the budget of chunk data on disk; past it the least recently
	// used chunks are deleted.
	Bytes int64
	// QueueBytes bounds the spilled bytes waiting for the writer (default
	// 64 MiB); a spill past it is dropped (counted), never waited for.
	QueueBytes int64
}

// Errors; check with errors.Is.
var (
	ErrConfig = errors.New("disk: bad config")
	// ErrMissing means a chunk is not on disk (never was, or evicted).
	ErrMissing = errors.New("disk: chunk not on disk")
	// ErrCorrupt means a chunk's bytes on disk failed their checksum; the
	// file was deleted.
	ErrCorrupt = errors.New("disk: chunk checksum mismatch")
)

// Notify is told, off any lock, which keys were written to (stored) or
// deleted from (removed) the disk, for the engine that spilled them.
type Notify func(engine string, stored, removed []messages.Key)

type item struct {
	key    messages.Key
	size   int64
	sum    uint32
	engine string
	elem   *list.Element
}

type spill struct {
	engine string
	key    messages.Key
	sum    uint32
	data   []byte
}

// Disk is the disk tier. Safe for concurrent use.
type Disk struct {
	cfg    Config
	notify Notify

	mu     sync.Mutex
	items  map[messages.Key]*item
	lru    *list.List // of *item; front is least recently used
	used   int64
	queued int64
	closed bool
	q      chan spill
	done   chan struct{}

	hits, evictions, readBytes, writeBytes, writeNanos, readNanos atomic.Int64
	dropped, raced, discarded, failed                             atomic.Int64
}

// Open rebuilds the index from cfg.Dir (verifying every record; deleting
// temporary and bad files) and starts the writer.
func Open(cfg Config, notify Notify) (*Disk, error) {
	if cfg.Dir == "" || cfg.Bytes <= 0 {
		return nil, fmt.Errorf("%w: dir %q, bytes %d", ErrConfig, cfg.Dir, cfg.Bytes)
	}
	if cfg.QueueBytes <= 0 {
		cfg.QueueBytes = 64 << 20
	}
	if notify == nil {
		notify = func(string, []messages.Key, []messages.Key) {}
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}
	d := &Disk{cfg: cfg, notify: notify, items: map[messages.Key]*item{}, lru: list.New(),
		q: make(chan spill, 1<<16), done: make(chan struct{})}
	if err := d.rebuild(); err != nil {
		return nil, err
	}
	go d.writer()
	return d, nil
}

func (d *Disk) path(key messages.Key) string {
	return filepath.Join(d.cfg.Dir, hex.EncodeToString([]byte(key))+".kv")
}

// rebuild indexes every intact record, oldest first by modification time,
// then trims to the budget.
func (d *Disk) rebuild() error {
	entries, err := os.ReadDir(d.cfg.Dir)
	if err != nil {
		return fmt.Errorf("disk: %w", err)
	}
	type found struct {
		it  *item
		mod time.Time
	}
	var all []found
	for _, e := range entries {
		name := filepath.Join(d.cfg.Dir, e.Name())
		switch {
		case strings.HasSuffix(e.Name(), ".tmp"): // a write that never reached its rename
			d.discard(name)
			continue
		case !strings.HasSuffix(e.Name(), ".kv") || !e.Type().IsRegular():
			continue
		}
		it, err := verifyFile(name)
		if err != nil || d.path(it.key) != name {
			d.discard(name)
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue
		}
		all = append(all, found{it, info.ModTime()})
	}
	slices.SortStableFunc(all, func(a, b found) int { return a.mod.Compare(b.mod) })
	for _, f := range all {
		f.it.elem = d.lru.PushBack(f.it)
		d.items[f.it.key] = f.it
		d.used += f.it.size
	}
	for d.used > d.cfg.Bytes {
		d.evictFront()
	}
	return nil
}

func (d *Disk) discard(name string) {
	d.discarded.Add(1)
	_ = os.Remove(name)
}

// verifyFile reads a whole record and checks both checksums and its length.
func verifyFile(name string) (*item, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h, err := readHeader(f)
	if err != nil {
		return nil, err
	}
	hash := crc32.New(castagnoli)
	n, err := io.Copy(hash, f)
	if err != nil {
		return nil, err
	}
	if n != h.size || hash.Sum32() != h.sum {
		return nil, fmt.Errorf("%w: %d of %d bytes, checksum %08x, want %08x", ErrBadRecord, n, h.size,
			hash.Sum32(), h.sum)
	}
	return &item{key: messages.Key(h.key), size: h.size, sum: h.sum}, nil
}

// Spill queues a chunk evicted from host memory for writing; sum is its
// CRC-32C. It never blocks: a full queue or a closed disk drops the chunk
// (counted) and returns false. The writer checks data against sum before
// writing, so bytes that changed after the sum was taken are dropped too.
func (d *Disk) Spill(engine string, key messages.Key, sum uint32, data []byte) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.items[key]; ok {
		return true
	}
	if d.closed || d.queued+int64(len(data)) > d.cfg.QueueBytes {
		d.dropped.Add(1)
		return false
	}
	select {
	case d.q <- spill{engine, key, sum, data}:
		d.queued += int64(len(data))
		return true
	default:
		d.dropped.Add(1)
		return false
	}
}

func (d *Disk) writer() {
	defer close(d.done)
	for sp := range d.q {
		d.write(sp)
		d.mu.Lock()
		d.queued -= int64(len(sp.data))
		d.mu.Unlock()
	}
}

// write puts one record in place (temporary name, then rename) and indexes
// it, evicting least recently used chunks past the budget.
func (d *Disk) write(sp spill) {
	if crc32.Checksum(sp.data, castagnoli) != sp.sum {
		d.raced.Add(1) // the host bytes were reused before they were copied out
		return
	}
	if int64(len(sp.data)) > d.cfg.Bytes {
		d.dropped.Add(1)
		return
	}
	start := time.Now()
	name := d.path(sp.key)
	if err := writeFile(name, string(sp.key), sp.sum, sp.data); err != nil {
		d.failed.Add(1)
		return
	}
	d.writeNanos.Add(int64(time.Since(start)))
	d.writeBytes.Add(int64(len(sp.data)))
	d.mu.Lock()
	if _, ok := d.items[sp.key]; ok {
		d.mu.Unlock()
		return
	}
	it := &item{key: sp.key, size: int64(len(sp.data)), sum: sp.sum, engine: sp.engine}
	it.elem = d.lru.PushBack(it)
	d.items[sp.key] = it
	d.used += it.size
	var removed []*item
	for d.used > d.cfg.Bytes {
		removed = append(removed, d.evictFront())
	}
	d.mu.Unlock()
	d.notify(sp.engine, []messages.Key{sp.key}, nil)
	d.announce(removed, sp.engine)
}

func writeFile(name, key string, sum uint32, data []byte) error {
	tmp := name + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(appendHeader(make([]byte, 0, headerLen(key)), key, int64(len(data)), sum))
	if err == nil {
		_, err = f.Write(data)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, name)
	}
	if err != nil {
		_ = os.Remove(tmp)
	}
	return err
}

// evictFront deletes the least recently used chunk. Caller holds d.mu.
func (d *Disk) evictFront() *item {
	it := d.lru.Remove(d.lru.Front()).(*item)
	delete(d.items, it.key)
	d.used -= it.size
	d.evictions.Add(1)
	_ = os.Remove(d.path(it.key))
	return it
}

// announce tells Notify about removed items, grouped by the engine that
// spilled them; items found at open (no engine known) go to fallback, the
// engine whose action removed them.
func (d *Disk) announce(removed []*item, fallback string) {
	by := map[string][]messages.Key{}
	for _, it := range removed {
		engine := it.engine
		if engine == "" {
			engine = fallback
		}
		by[engine] = append(by[engine], it.key)
	}
	for engine, keys := range by {
		d.notify(engine, nil, keys)
	}
}

// Has reports whether key is on disk, and its size and checksum.
func (d *Disk) Has(key messages.Key) (size int64, sum uint32, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	it, ok := d.items[key]
	if !ok {
		return 0, 0, false
	}
	return it.size, it.sum, true
}

// ReadInto reads key's bytes into dst, in order (the host extents its load
// made room for), checking them against the record's checksum, and returns
// that checksum. A missing chunk is ErrMissing; a corrupt or unreadable one
// is deleted and reported as ErrCorrupt (Notify hears it as removed, for
// engine if the chunk was found at open).
func (d *Disk) ReadInto(engine string, key messages.Key, dst [][]byte) (uint32, error) {
	start := time.Now()
	d.mu.Lock()
	it, ok := d.items[key]
	if ok {
		d.lru.MoveToBack(it.elem)
	}
	d.mu.Unlock()
	if !ok {
		return 0, fmt.Errorf("%w: key %x", ErrMissing, string(key))
	}
	sum, n, err := readRecord(d.path(key), key, dst)
	if errors.Is(err, fs.ErrNotExist) { // evicted since the index was read
		return 0, fmt.Errorf("%w: key %x", ErrMissing, string(key))
	}
	if err != nil {
		d.Drop(engine, key)
		return 0, fmt.Errorf("%w: key %x: %v", ErrCorrupt, string(key), err)
	}
	if sum != it.sum {
		d.Drop(engine, key)
		return 0, fmt.Errorf("%w: key %x: checksum %08x, indexed %08x", ErrCorrupt, string(key), sum, it.sum)
	}
	d.hits.Add(1)
	d.readBytes.Add(n)
	d.readNanos.Add(int64(time.Since(start)))
	return sum, nil
}

func readRecord(name string, key messages.Key, dst [][]byte) (uint32, int64, error) {
	f, err := os.Open(name)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	h, err := readHeader(f)
	if err != nil {
		return 0, 0, err
	}
	var want int64
	for _, b := range dst {
		want += int64(len(b))
	}
	if h.key != string(key) || h.size != want {
		return 0, 0, fmt.Errorf("%w: record of key %x, %d bytes; want %d", ErrBadRecord, h.key, h.size, want)
	}
	var sum uint32
	for _, b := range dst {
		if _, err := io.ReadFull(f, b); err != nil {
			return 0, 0, fmt.Errorf("%w: %v", ErrBadRecord, err)
		}
		sum = crc32.Update(sum, castagnoli, b)
	}
	if sum != h.sum {
		return 0, 0, fmt.Errorf("checksum %08x, record says %08x", sum, h.sum)
	}
	return sum, want, nil
}

// Drop deletes key from disk (announced as removed; for engine if the chunk
// was found at open).
func (d *Disk) Drop(engine string, key messages.Key) {
	d.mu.Lock()
	it, ok := d.items[key]
	if ok {
		d.lru.Remove(it.elem)
		delete(d.items, key)
		d.used -= it.size
		_ = os.Remove(d.path(key))
	}
	d.mu.Unlock()
	if ok {
		d.announce([]*item{it}, engine)
	}
}

// Keys lists the keys on disk, least recently used first.
func (d *Disk) Keys() []messages.Key {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]messages.Key, 0, d.lru.Len())
	for e := d.lru.Front(); e != nil; e = e.Next() {
		out = append(out, e.Value.(*item).key)
	}
	return out
}

// Close stops taking spills and waits for the writer to finish the queue.
func (d *Disk) Close() {
	d.mu.Lock()
	if !d.closed {
		d.closed = true
		close(d.q)
	}
	d.mu.Unlock()
	<-d.done
}

// Stats is a point-in-time view of the disk tier.
type Stats struct {
	Budget     int64 `json:"budget_bytes"`
	Bytes      int64 `json:"bytes"`
	Chunks     int   `json:"chunks"`
	Queued     int64 `json:"queued_bytes"`
	Hits       int64 `json:"hits"`
	Evictions  int64 `json:"evictions"`
	ReadBytes  int64 `json:"read_bytes"`
	WriteBytes int64 `json:"write_bytes"`
	ReadNanos  int64 `json:"read_nanos"`
	WriteNanos int64 `json:"write_nanos"`
	Dropped    int64 `json:"dropped"`   // spills not written: queue full, closed, too large
	Raced      int64 `json:"raced"`     // spills whose host bytes changed before the copy-out
	Discarded  int64 `json:"discarded"` // temporary or bad files deleted at open
	Failed     int64 `json:"failed"`    // writes that failed
}

func (d *Disk) Stats() Stats {
	d.mu.Lock()
	st := Stats{Budget: d.cfg.Bytes, Bytes: d.used, Chunks: len(d.items), Queued: d.queued}
	d.mu.Unlock()
	st.Hits, st.Evictions = d.hits.Load(), d.evictions.Load()
	st.ReadBytes, st.WriteBytes = d.readBytes.Load(), d.writeBytes.Load()
	st.ReadNanos, st.WriteNanos = d.readNanos.Load(), d.writeNanos.Load()
	st.Dropped, st.Raced, st.Discarded, st.Failed = d.dropped.Load(), d.raced.Load(), d.discarded.Load(),
		d.failed.Load()
	return st
}
