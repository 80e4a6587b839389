package disk

import (
	"container/list"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/ratelog"
)

// Config is the disk tier's settings.
type Config struct {
	// Dir holds the segment files; created if missing.
	Dir string
	// Bytes is the budget of live chunk data on disk; past it the least
	// recently used chunks are dropped. Segment files may hold up to half as
	// much again in dropped records before the oldest segment is deleted
	// (record headers count; tombstones do not), for any budget.
	Bytes int64
	// SegmentBytes is the size at which the writer starts a new segment
	// (default: Bytes/16, at least 1 MiB, at most 256 MiB, and never more
	// than Bytes/4: defaultSegmentBytes). More than 1.5 × Bytes is
	// refused (ErrConfig): the segment being written is never deleted, so
	// it alone would pass the bound on dropped records.
	SegmentBytes int64
	// MaxChunks bounds the chunks the tier holds, whatever their size
	// (0: defaultMaxChunks); past it the least recently used are
	// dropped, as past Bytes. Each costs its index ~190 bytes of the node's
	// memory, and an engine's spec may make chunks of a byte.
	MaxChunks int64
	// QueueBytes bounds the spilled bytes waiting for the writer (default
	// 64 MiB); a spill past it is dropped (counted), never waited for. A
	// chunk larger than QueueBytes is taken into an empty queue.
	QueueBytes int64
	// TombstoneRetry is how long after a failed tombstone write the writer
	// tries it again unless something woke it sooner (default 1s).
	TombstoneRetry time.Duration
	// Log takes the tier's warnings (nil: slog.Default()).
	Log *slog.Logger

	// beforeOpen, in tests, runs between the rebuild's listing of the
	// directory and its open of each segment listed (the window in which
	// the entry can be swapped for another kind of file).
	beforeOpen func(path string)
	// readSegment, in tests, wraps the rebuild's reader of each segment
	// (to fail a read as a disk would: EIO).
	readSegment func(path string, r io.Reader) io.Reader
	// remove, in tests, deletes a segment file in place of os.Remove (to
	// fail a delete).
	remove func(path string) error
	// segmentOut, in tests, wraps what the writer writes each segment
	// through (to fill the filesystem: ENOSPC).
	segmentOut func(f *os.File) appendFile
	// now, in tests, is the clock of the full filesystem's log limit (nil:
	// time.Now).
	now func() time.Time
	// betweenSlices, in tests, runs between ReannouncePrefix's holds of the
	// lock, with the lock released (to work on the tier mid-walk).
	betweenSlices func()
}

// Errors; check with errors.Is.
var (
	ErrConfig = errors.New("disk: bad config")
	// ErrMissing means a chunk is not on disk (never was, or evicted).
	ErrMissing = errors.New("disk: chunk not on disk")
	// ErrCorrupt means a chunk's bytes on disk failed their checksum; it was
	// dropped.
	ErrCorrupt = errors.New("disk: chunk checksum mismatch")
	// ErrLocked means another Disk (another node on this host, or one not
	// yet closed in this process) has the directory open: Open refuses to
	// share it, since each would cut the other's record being written as a
	// torn tail, reuse its segment ids and delete its segments.
	ErrLocked = errors.New("disk: directory in use by another disk tier")
)

// lockName is the file in Dir whose exclusive flock a Disk holds while open.
const lockName = "LOCK"

// Notify is told which keys were written to (stored) or dropped from
// (removed) the disk, for the engine that spilled them, under the disk's
// lock and so in the order the index changed: it must return fast and must
// not call the Disk (a node queues the keys for its kv_events journal).
type Notify func(engine string, stored, removed []messages.Key)

type item struct {
	key    messages.Key
	seg    *segment
	off    int64 // where the data starts in the segment
	size   int64
	sum    uint32
	engine string
	elem   *list.Element
}

// segment is one append-only file of records.
type segment struct {
	id    int
	f     *os.File
	out   appendFile // where the writer writes f (tests wrap it to fail)
	size  int64      // bytes written (records whole or, at rebuild, verified)
	live  int        // indexed records in it
	marks int64      // bytes of tombstones in it (in size)
	// removeFailed: a delete of the file failed (counted and logged once
	// per segment; it stays, and the delete is tried again).
	removeFailed bool
	// retired: a failed write could not be cut back, so the file may hold
	// bytes past size, and an append would land there, not at size, where
	// its records would be indexed. The writer starts a new segment
	// instead; the records before size still read. Only the writer reads
	// or sets it.
	retired bool
}

// appendFile is what the writer needs of a segment file, opened O_APPEND:
// a write lands at the file's end, which is seg.size while every failed
// write is cut back.
type appendFile interface {
	Write(b []byte) (int, error)
	Truncate(size int64) error
}

// tombstone is a dropped record's tombstone, waiting for the writer.
type tombstone struct {
	key messages.Key
	seg int
	off int64
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

	mu        sync.Mutex
	items     map[messages.Key]*item
	lru       *list.List  // of *item; front is least recently used
	segs      []*segment  // oldest first; the last is being written
	used      int64       // live data bytes
	fileBytes int64       // bytes of every segment
	markBytes int64       // bytes of tombstones in the segments (in fileBytes)
	tombs     []tombstone // of records dropped, for the writer to write
	queued    int64
	closed    bool
	shut      bool // Close closed the files and let the directory go: nothing is dropped or deleted now
	q         chan spill
	done      chan struct{}
	kick      chan struct{} // wakes the writer for tombs
	lock      *os.File      // holds the directory's flock (lockName) until Close
	// rebuildHeld is the most entries the rebuild held at once: records
	// indexed, a segment's records and tombstones read, the keys and
	// tombstones of dropped records walked past (tests).
	rebuildHeld int

	hits, evictions, writes, readBytes, writeBytes, writeNanos, readNanos atomic.Int64
	dropped, raced, discarded, failed, retired, removeFailed              atomic.Int64
	full                                                                  atomic.Int64 // writes that found the filesystem full
	longKeyLogged                                                         atomic.Bool  // a long key's drop was logged

	fullLog *ratelog.Limiter // of logFull's lines
}

// Open rebuilds the index from cfg.Dir (verifying every record; cutting a
// torn tail off a segment and skipping records that fail their checksum;
// failing, with nothing cut, where a read fails) and starts the writer on a
// new segment (or on the newest, where it holds no live chunk). It first takes an exclusive flock on
// the file LOCK in cfg.Dir, held until Close: a directory another Disk has
// open, in this process or another, is ErrLocked.
func Open(cfg Config, notify Notify) (*Disk, error) {
	if cfg.Dir == "" || cfg.Bytes <= 0 {
		return nil, fmt.Errorf("%w: dir %q, bytes %d", ErrConfig, cfg.Dir, cfg.Bytes)
	}
	if cfg.SegmentBytes <= 0 {
		cfg.SegmentBytes = defaultSegmentBytes(cfg.Bytes)
	}
	if cfg.SegmentBytes-cfg.Bytes > cfg.Bytes/2 {
		return nil, fmt.Errorf("%w: SegmentBytes %d over 1.5 × Bytes %d: the segment being written would hold more dropped records than the budget allows",
			ErrConfig, cfg.SegmentBytes, cfg.Bytes)
	}
	if cfg.MaxChunks <= 0 {
		cfg.MaxChunks = defaultMaxChunks(cfg.Bytes)
	}
	if cfg.TombstoneRetry <= 0 {
		cfg.TombstoneRetry = time.Second
	}
	if cfg.QueueBytes <= 0 {
		cfg.QueueBytes = 64 << 20
	}
	if notify == nil {
		notify = func(string, []messages.Key, []messages.Key) {}
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}
	lock, err := lockDir(cfg.Dir)
	if err != nil {
		return nil, err
	}
	d := &Disk{cfg: cfg, notify: notify, items: map[messages.Key]*item{}, lru: list.New(),
		q: make(chan spill, 1<<16), done: make(chan struct{}), kick: make(chan struct{}, 1), lock: lock,
		fullLog: ratelog.New(1, fullLogEvery)}
	if err := d.rebuild(); err != nil {
		d.closeFiles()
		return nil, err
	}
	// A boot that wrote only tombstones (it dropped chunks, spilled none)
	// left a segment with no live chunk, which no drop deletes while an
	// older one holds a live chunk: the writer appends to it (the rebuild
	// read it to its end, cutting any torn tail) rather than each boot of a
	// crash loop adding a file, and an open descriptor.
	if n := len(d.segs); n == 0 || d.segs[n-1].live > 0 || d.segs[n-1].size >= cfg.SegmentBytes {
		if err := d.newSegment(); err != nil {
			d.closeFiles()
			return nil, err
		}
	}
	go d.writer()
	return d, nil
}

// defaultSegmentBytes is the segment size for budget: a sixteenth of it,
// 1 MiB at least (fewer files) and 256 MiB at most, but never more than a
// quarter of it. dropDead never deletes the segment being written, so that
// segment alone may hold SegmentBytes of records, dropped ones included;
// and with chunks evicted in write order a segment's dropped records stay
// until its last live chunk goes, so the files hold the budget plus up to
// a segment of dropped records. A quarter keeps that under half the budget
// again with a quarter left for record headers: in write-order use no
// segment is deleted with live chunks in it, and where one is (chunks
// read back stay live in old segments) it takes at most a quarter of the
// budget. The 1 MiB floor alone made a 4 KiB budget's one segment grow to
// ~860 KB of dropped records, then go with nearly every live chunk.
func defaultSegmentBytes(budget int64) int64 {
	return max(min(max(budget/16, 1<<20), 256<<20, budget/4), 1)
}

// defaultMaxChunks is a chunk per 4 KiB of budget, at least 65,536: the
// index then costs at most ~5% of the budget in memory (real KV chunks are
// tens of KiB and more), and small budgets of small chunks are not cut.
// Without a bound, a budget of one-byte chunks let the index hold ~25M
// chunks per GiB (the files' bound on records, 65 bytes each with their
// headers, stops them there) at ~190 bytes of heap each: 4.7 GB.
func defaultMaxChunks(budget int64) int64 { return max(budget/4096, 1<<16) }

const segSuffix = ".kvseg"

func (d *Disk) segPath(id int) string {
	return filepath.Join(d.cfg.Dir, fmt.Sprintf("%08d%s", id, segSuffix))
}

func (d *Disk) index(it *item) {
	it.elem = d.lru.PushBack(it)
	d.items[it.key] = it
	d.used += it.size
	it.seg.live++
}

// indexOlder indexes it as the least recently used: the rebuild, walking
// back from the newest record, finds each record it keeps before those
// indexed already.
func (d *Disk) indexOlder(it *item) {
	d.index(it)
	d.lru.MoveToFront(it.elem)
}

func (d *Disk) unindex(it *item) {
	d.lru.Remove(it.elem)
	delete(d.items, it.key)
	d.used -= it.size
	it.seg.live--
}

// forget unindexes a dropped record whose bytes stay in their segment and
// queues its tombstone for the writer, so a restart does not bring it back
// (a record replaced by a later one of its key needs none: the rebuild
// keeps the later). Caller holds d.mu.
func (d *Disk) forget(it *item) {
	d.unindex(it)
	d.tombs = append(d.tombs, tombstone{key: it.key, seg: it.seg.id, off: it.off})
}

// wakeWriter has the writer write the queued tombstones, without waiting.
func (d *Disk) wakeWriter() {
	select {
	case d.kick <- struct{}{}:
	default: // already woken
	}
}

// maxSegmentID is the largest segment id: a tombstone names its record's
// segment in 32 bits.
const maxSegmentID = math.MaxUint32

func (d *Disk) newSegment() error {
	id := 1
	if n := len(d.segs); n > 0 {
		id = d.segs[n-1].id + 1
	}
	for ; ; id++ {
		if id > maxSegmentID {
			return fmt.Errorf("disk: segment ids exhausted (a file %s in the disk directory): clear it", filepath.Base(d.segPath(id-1)))
		}
		f, err := os.OpenFile(d.segPath(id), os.O_CREATE|os.O_EXCL|os.O_RDWR|os.O_APPEND, 0o600)
		if errors.Is(err, fs.ErrExist) {
			// A name of ours the rebuild did not read (a symlink, a
			// directory): not ours to open or delete; step past it (as
			// many times as the directory has entries).
			continue
		}
		if err != nil {
			return fmt.Errorf("disk: %w", err)
		}
		d.segs = append(d.segs, &segment{id: id, f: f, out: d.outOf(f)})
		return nil
	}
}

// outOf is what the writer writes segment file f through.
func (d *Disk) outOf(f *os.File) appendFile {
	if d.cfg.segmentOut != nil {
		return d.cfg.segmentOut(f)
	}
	return f
}

// evictFront drops the least recently used chunk. Caller holds d.mu.
func (d *Disk) evictFront() *item {
	it := d.oldest() // there is one: the caller is over the budget
	d.forget(it)
	d.evictions.Add(1)
	return it
}

// dropDead deletes old segments with no live record, and while the files
// hold more than half the budget again in dropped records (tombstones not
// counted: the rebuild, which counts them, must not delete a segment the
// run did not), the oldest segment with the live records still in it
// (counted as evictions). A segment whose file fails to delete stays whole
// (its bytes counted, its chunks served) and ends the pass: the next one
// tries it again. Caller holds d.mu; it returns the chunks dropped.
func (d *Disk) dropDead() []*item {
	if d.shut {
		return nil
	}
	var removed []*item
	for len(d.segs) > 1 {
		seg := d.segs[0]
		if seg.live > 0 && d.fileBytes-d.markBytes <= d.cfg.Bytes+d.cfg.Bytes/2 {
			break
		}
		gone, ok := d.dropOldest()
		removed = append(removed, gone...)
		if !ok {
			break
		}
	}
	return removed
}

// dropOldest deletes the oldest segment, not the one being written, with
// the live records still in it (counted as evictions), and returns them;
// false if there is none to delete or its file failed to delete (then it
// stays whole: its bytes counted, its chunks served; the next pass tries
// it again). Caller holds d.mu.
func (d *Disk) dropOldest() ([]*item, bool) {
	if d.shut || len(d.segs) < 2 {
		return nil, false
	}
	seg := d.segs[0]
	// Deleted before anything is dropped: a file that stays still takes
	// its bytes, and its records would come back at the next start
	// (tombstones are written only for the segments kept).
	if !d.removeFile(seg.f.Name(), !seg.removeFailed) {
		seg.removeFailed = true
		return nil, false
	}
	var removed []*item
	for e := d.lru.Front(); e != nil && seg.live > 0; {
		next := e.Next()
		if it, ok := e.Value.(*item); ok && it.seg == seg {
			d.unindex(it)
			d.evictions.Add(1)
			removed = append(removed, it)
		}
		e = next
	}
	d.segs = d.segs[1:]
	d.fileBytes -= seg.size
	d.markBytes -= seg.marks
	_ = seg.f.Close()
	return removed, true
}

// removeFile deletes a segment file; one already gone counts as deleted.
// A failure is counted and, where report, logged.
func (d *Disk) removeFile(path string, report bool) bool {
	remove := os.Remove
	if d.cfg.remove != nil {
		remove = d.cfg.remove
	}
	err := remove(path)
	if err == nil || errors.Is(err, fs.ErrNotExist) {
		return true
	}
	if report {
		d.removeFailed.Add(1)
		d.cfg.Log.Warn("disk: a segment could not be deleted; it is kept and tried again", "path", path, "err", err)
	}
	return false
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

// Where is the segment file and data offset of key (tests and tools).
func (d *Disk) Where(key messages.Key) (path string, off int64, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	it, ok := d.items[key]
	if !ok {
		return "", 0, false
	}
	return it.seg.f.Name(), it.off, true
}

// Drop drops key from disk (announced as removed; for engine if the chunk
// was found at open). Its bytes stay in the segment until the segment goes.
func (d *Disk) Drop(engine string, key messages.Key) {
	d.mu.Lock()
	it := d.items[key]
	d.mu.Unlock()
	if it != nil {
		d.dropItem(engine, it)
	}
}

// dropItem drops record it if key still names it, and reports whether it
// did: a read that found it bad must not drop a newer record of the key
// (spilled again while the read ran). After Close it drops nothing: no
// tombstone would be written, so the removal told would not hold.
func (d *Disk) dropItem(engine string, it *item) bool {
	d.mu.Lock()
	if d.shut || d.items[it.key] != it {
		d.mu.Unlock()
		return false
	}
	d.tell(d.dropLocked(engine, it)) // under the lock: in the index's order (Notify)
	d.mu.Unlock()
	d.wakeWriter()
	return true
}

// dropLocked drops records items (tombstoned by the writer, which the
// caller wakes) and the segments that leaves dead, and returns the
// removals to tell, each for engine. Caller holds d.mu.
func (d *Disk) dropLocked(engine string, items ...*item) []change {
	changes := make([]change, 0, len(items))
	for _, it := range items {
		d.forget(it)
		changes = append(changes, removal(it, engine))
	}
	for _, gone := range d.dropDead() {
		changes = append(changes, removal(gone, engine))
	}
	return changes
}

// oldest is the least recently used chunk, nil if none.
func (d *Disk) oldest() *item {
	for e := d.lru.Front(); e != nil; e = e.Next() {
		if it, ok := e.Value.(*item); ok {
			return it
		}
	}
	return nil
}

// Keys lists the keys on disk, least recently used first.
func (d *Disk) Keys() []messages.Key {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]messages.Key, 0, d.lru.Len())
	for e := d.lru.Front(); e != nil; e = e.Next() {
		if it, ok := e.Value.(*item); ok {
			out = append(out, it.key)
		}
	}
	return out
}

// Close stops taking spills, waits for the writer to finish the queue and
// closes the files. A Drop or read after it changes nothing on disk.
func (d *Disk) Close() {
	d.mu.Lock()
	first := !d.closed
	if first {
		d.closed = true
		close(d.q)
	}
	d.mu.Unlock()
	<-d.done
	if first {
		d.mu.Lock()
		d.closeFiles()
		d.shut = true
		d.mu.Unlock()
	}
}

// closeFiles closes the segment files, then lets the directory's lock go.
func (d *Disk) closeFiles() {
	for _, seg := range d.segs {
		_ = seg.f.Close()
	}
	if d.lock != nil {
		_ = d.lock.Close() // releases the flock
		d.lock = nil
	}
}

// lockDir takes the exclusive flock of dir's lock file, without waiting
// (ErrLocked if another holds it). The lock goes with the file's close, or
// the process's end: a node that crashed leaves no stale lock behind.
func lockDir(dir string) (*os.File, error) {
	path := filepath.Join(dir, lockName)
	// O_NOFOLLOW: a LOCK that is a symlink is refused, not followed out
	// of the directory (O_CREATE would create what it names).
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("disk: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is locked (%s): is another kvactors node using this --disk-dir?",
				ErrLocked, dir, path)
		}
		return nil, fmt.Errorf("disk: lock %s: %w", path, err)
	}
	return f, nil
}
