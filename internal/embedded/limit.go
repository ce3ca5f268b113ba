package embedded

import (
	"log/slog"
	"slices"
	"sort"
	"strings"
	"time"
)

// The embedded server's repeated lines are rate-limited per pattern (the line with its clients'
// addresses, ids, quoted names and numbers taken out, see normalise): of a pattern's lines in a
// minute the first 10 are logged and the others counted, and their count is said in a summary line
// at most every 10 s while they come, and once more when the server shuts down. A flood of refused
// clients is then at most 10 lines and 6 summaries a minute, and a line said once always passes.
//
// Lines that differ after normalisation (a stream's or a subject's name, anything normalise does not
// catch) are bounded as a whole: each level (notices, warnings, errors) logs at most 60 lines a
// minute, all its patterns together, and counts the others; at most 256 patterns are tracked, and the
// lines of a new one while the table is full share one budget of 10 a minute per level; a round of
// summaries names at most 5 patterns (and the critical ones), the rest said together in one line. A flood of lines all different is
// then at most 60 lines and 6 summaries a minute per level, however long it lasts. The lines an
// operator must see (critical: JetStream out of space or resources, out of descriptors or disk) have
// a budget of 10 a minute per kind outside all of that, so no flood holds them back, and the server's
// fatal lines always pass.
const (
	linesPerWindow = 10
	patternWindow  = time.Minute
	summaryEvery   = 10 * time.Second
	// levelLinesPerWindow bounds the lines of a level logged in a patternWindow, all patterns
	// together: about one a second.
	levelLinesPerWindow = 60
	// maxPatterns bounds the patterns tracked; past it a new pattern's lines are counted in its
	// level's "other" pattern, until a pattern idle for a window is forgotten.
	maxPatterns = 256
	// maxPatternLen bounds a pattern's length: lines alike in their first 1 KiB count as one.
	maxPatternLen = 1024
	// maxNamedSummaries bounds the patterns a flush names; the others' counts are said in one line.
	maxNamedSummaries = 5
	// pruneEvery bounds how often a full table is searched for patterns to forget.
	pruneEvery = time.Second
)

// The summary lines' messages.
const (
	// summaryMsg: a pattern's lines not logged, past its own budget; its fields say which pattern,
	// how many and over how long.
	summaryMsg = "embedded server: more lines like this were not logged"
	// foldedMsg: the lines not logged of the patterns a flush does not name, with how many patterns.
	foldedMsg = "embedded server: more lines of other patterns were not logged"
	// budgetMsg: a level's lines not logged past levelLinesPerWindow, each within its pattern's budget.
	budgetMsg = "embedded server: lines past the log's budget of a minute were not logged"
)

// otherPattern is the pattern of the lines of new patterns while the table is full.
const otherPattern = "(patterns past the 256 tracked)"

// criticals are the lines an operator must see, each at least once a minute whatever else floods:
// a line of warning or error level that holds one of them is limited by it alone (its pattern is
// the text, of any line holding it), 10 a minute, outside the levels' budgets and the table.
var criticals = []string{
	"JetStream out of",         // JetStream out of (file|memory) resources / out of space, will be DISABLED
	"resource limits exceeded", // JetStream (file|memory) resource limits exceeded for server / account
	"disabling JetStream",      // File system permission denied while writing, disabling JetStream
	"too many open files",      // accept4: too many open files; a store's open
	"no space left on device",
}

type patternKey struct {
	level slog.Level
	text  string
}

type pattern struct {
	windowStart time.Time // of the current window
	lines       int       // lines of the current window, logged or not
	suppressed  int       // lines not logged since the last summary
	since       time.Time // the first of them
}

// take counts a line of the pattern at now, and says whether its budget lets it through; if not, the
// line is counted as suppressed.
func (p *pattern) take(now time.Time) bool {
	if now.Sub(p.windowStart) >= patternWindow {
		p.windowStart, p.lines = now, 0
	}
	p.lines++
	if p.lines <= linesPerWindow {
		return true
	}
	p.hold(now)
	return false
}

func (p *pattern) hold(now time.Time) {
	if p.suppressed == 0 {
		p.since = now
	}
	p.suppressed++
}

// summary is a count of lines not logged: a pattern's (msg summaryMsg), several patterns' (foldedMsg,
// patterns above 1) or a level's past its budget (budgetMsg, no pattern).
type summary struct {
	msg        string
	level      slog.Level
	pattern    string
	patterns   int
	suppressed int
	in         time.Duration // from the first of them to the summary
}

// limiter decides which lines are logged. It holds no lock and no clock: its owner (slogAdapter)
// locks it and gives it the time.
type limiter struct {
	patterns  map[patternKey]*pattern // at most maxPatterns
	others    map[slog.Level]*pattern // the lines of new patterns while patterns is full
	criticals map[patternKey]*pattern // the text is one of criticals
	levels    map[slog.Level]*pattern // each level's budget: lines logged, and those held past it
	lastPrune time.Time
}

func newLimiter() *limiter {
	return &limiter{patterns: map[patternKey]*pattern{}, others: map[slog.Level]*pattern{},
		criticals: map[patternKey]*pattern{}, levels: map[slog.Level]*pattern{}}
}

func get[K comparable](m map[K]*pattern, k K, now time.Time) *pattern {
	p := m[k]
	if p == nil {
		p = &pattern{windowStart: now}
		m[k] = p
	}
	return p
}

// line says whether a line of level whose text is msg is logged. Each line not logged is counted
// once: in its pattern's summary, or in its level's.
func (l *limiter) line(now time.Time, level slog.Level, msg string) bool {
	if level >= slog.LevelWarn {
		for _, c := range criticals {
			if strings.Contains(msg, c) {
				return get(l.criticals, patternKey{level, c}, now).take(now)
			}
		}
	}
	k := patternKey{level, normalise(msg)}
	p := l.patterns[k]
	if p == nil {
		if len(l.patterns) >= maxPatterns && now.Sub(l.lastPrune) >= pruneEvery {
			l.prune(now)
		}
		if len(l.patterns) < maxPatterns {
			p = get(l.patterns, k, now)
		} else {
			p = get(l.others, level, now)
		}
	}
	if !p.take(now) {
		return false
	}
	b := get(l.levels, level, now)
	if now.Sub(b.windowStart) >= patternWindow {
		b.windowStart, b.lines = now, 0
	}
	if b.lines >= levelLinesPerWindow {
		b.hold(now)
		return false
	}
	b.lines++
	return true
}

// prune forgets the patterns whose window ended and that owe no summary.
func (l *limiter) prune(now time.Time) {
	l.lastPrune = now
	for k, p := range l.patterns {
		if p.suppressed == 0 && now.Sub(p.windowStart) >= patternWindow {
			delete(l.patterns, k)
		}
	}
}

// flush gives the summaries owed, and forgets the patterns whose window ended and that owe none: the
// critical groups' first, then at most maxNamedSummaries other patterns, those that held back the
// most lines, and the rest together in one line; then each level's lines held past its budget.
func (l *limiter) flush(now time.Time) []summary {
	var out, named []summary
	owed := func(m map[patternKey]*pattern, to *[]summary) {
		for k, p := range m {
			if p.suppressed > 0 {
				*to = append(*to, summary{summaryMsg, k.level, k.text, 1, p.suppressed, now.Sub(p.since)})
				p.suppressed = 0
			} else if now.Sub(p.windowStart) >= patternWindow {
				delete(m, k)
			}
		}
	}
	// The critical groups' are always named (first; at most one per group and level).
	owed(l.criticals, &out)
	owed(l.patterns, &named)
	for level, p := range l.others {
		if p.suppressed > 0 {
			named = append(named, summary{summaryMsg, level, otherPattern, 1, p.suppressed, now.Sub(p.since)})
			p.suppressed = 0
		}
	}
	most := func(s []summary) {
		sort.Slice(s, func(i, j int) bool {
			a, b := s[i], s[j]
			if a.suppressed != b.suppressed {
				return a.suppressed > b.suppressed
			}
			if a.level != b.level {
				return a.level > b.level
			}
			return a.pattern < b.pattern
		})
	}
	most(out)
	most(named)
	if len(named) <= maxNamedSummaries {
		out = append(out, named...)
	} else {
		out = append(out, named[:maxNamedSummaries]...)
		f := summary{msg: foldedMsg, level: slog.LevelDebug}
		for _, s := range named[maxNamedSummaries:] {
			f.level = max(f.level, s.level)
			f.patterns++
			f.suppressed += s.suppressed
			f.in = max(f.in, s.in)
		}
		out = append(out, f)
	}
	levels := make([]slog.Level, 0, len(l.levels))
	for level, b := range l.levels {
		if b.suppressed > 0 {
			levels = append(levels, level)
		}
	}
	slices.Sort(levels)
	for _, level := range slices.Backward(levels) {
		b := l.levels[level]
		out = append(out, summary{msg: budgetMsg, level: level, suppressed: b.suppressed, in: now.Sub(b.since)})
		b.suppressed = 0
	}
	return out
}

// normalise is a line's pattern: what varies from client to client is replaced, so that lines
// differing only by client count as one. IPv4 and bracketed IPv6 addresses, with their ports, become
// <addr>; double-quoted strings (a client's name and version, its account and user, a subject)
// become "..."; a number that is no part of a word (cid:17, 5123 chars, 2.5s) becomes <n>. Words
// keep their digits: a stream composed-17 stays itself.
func normalise(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s) && b.Len() < maxPatternLen; {
		c := s[i]
		switch {
		case isLetter(c) || c == '_':
			j := i + 1
			for j < len(s) && (isWord(s[j]) || s[j] == '.') {
				j++
			}
			b.WriteString(s[i:j])
			i = j
		case c == '"':
			j := closingQuote(s, i)
			if j < 0 {
				b.WriteString(s[i:])
				i = len(s)
				break
			}
			b.WriteString(`"..."`)
			i = j + 1
		case c == '[':
			if j := ipv6End(s, i); j > 0 {
				b.WriteString("<addr>")
				i = j
				break
			}
			b.WriteByte(c)
			i++
		case isDigit(c):
			if j := ipv4End(s, i); j > 0 {
				b.WriteString("<addr>")
				i = j
				break
			}
			j := digits(s, i)
			for j+1 < len(s) && s[j] == '.' && isDigit(s[j+1]) {
				j = digits(s, j+1)
			}
			b.WriteString("<n>")
			i = j
		default:
			b.WriteByte(c)
			i++
		}
	}
	out := b.String()
	if len(out) > maxPatternLen {
		out = out[:maxPatternLen]
	}
	return out
}

func isDigit(c byte) bool  { return '0' <= c && c <= '9' }
func isLetter(c byte) bool { return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' }
func isWord(c byte) bool   { return isLetter(c) || isDigit(c) || c == '_' || c == '-' }

func digits(s string, i int) int {
	for i < len(s) && isDigit(s[i]) {
		i++
	}
	return i
}

// port is the end of a ":<digits>" at i, or i when there is none.
func port(s string, i int) int {
	if i+1 < len(s) && s[i] == ':' && isDigit(s[i+1]) {
		return digits(s, i+1)
	}
	return i
}

// ipv4End is the end of the dotted quad (and port) at i, or 0.
func ipv4End(s string, i int) int {
	for n := range 4 {
		j := digits(s, i)
		if j == i || j-i > 3 {
			return 0
		}
		i = j
		if n < 3 {
			if i >= len(s) || s[i] != '.' {
				return 0
			}
			i++
		}
	}
	if i < len(s) && (isWord(s[i]) || s[i] == '.' && i+1 < len(s) && isDigit(s[i+1])) {
		return 0
	}
	return port(s, i)
}

// ipv6End is the end of the bracketed IPv6 address (and port) at i, or 0.
func ipv6End(s string, i int) int {
	colons := 0
	for j := i + 1; j < len(s); j++ {
		switch c := s[j]; {
		case c == ']':
			if colons < 2 {
				return 0
			}
			return port(s, j+1)
		case c == ':':
			colons++
		case isDigit(c) || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F' || c == '.' || c == '%' || isWord(c):
		default:
			return 0
		}
	}
	return 0
}

// closingQuote is the index of the quote closing the one at i, or -1.
func closingQuote(s string, i int) int {
	for j := i + 1; j < len(s); j++ {
		switch s[j] {
		case '\\':
			j++
		case '"':
			return j
		}
	}
	return -1
}
