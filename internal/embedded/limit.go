package embedded

import (
	"log/slog"
	"strings"
	"time"
)

// The embedded server's repeated lines are rate-limited per pattern (the line with its clients'
// addresses, ids, quoted names and numbers taken out, see normalise): of a pattern's lines in a
// minute the first 10 are logged and the others counted, and their count is said in a summary line
// at most every 10 s while they come, and once more when the server shuts down. A flood of refused
// clients is then at most 10 lines and 6 summaries a minute, and a line said once always passes.
const (
	linesPerWindow = 10
	patternWindow  = time.Minute
	summaryEvery   = 10 * time.Second
	// maxPatterns bounds the patterns tracked; past it the one seen longest ago is forgotten (its
	// count said first).
	maxPatterns = 256
	// maxPatternLen bounds a pattern's length: lines alike in their first 1 KiB count as one.
	maxPatternLen = 1024
)

// summaryMsg is the summary line's message; its fields say which pattern, how many of its lines were
// not logged and over how long.
const summaryMsg = "embedded server: more lines like this were not logged"

type patternKey struct {
	level slog.Level
	text  string
}

type pattern struct {
	windowStart time.Time // of the current window
	lines       int       // lines of the current window, logged or not
	suppressed  int       // lines not logged since the last summary
	since       time.Time // the first of them
	lastSeen    time.Time
}

// summary is a pattern's count of lines not logged.
type summary struct {
	level      slog.Level
	pattern    string
	suppressed int
	in         time.Duration // from the first of them to the summary
}

// limiter decides which lines are logged. It holds no lock and no clock: its owner (slogAdapter)
// locks it and gives it the time.
type limiter struct {
	patterns map[patternKey]*pattern
}

func newLimiter() *limiter {
	return &limiter{patterns: map[patternKey]*pattern{}}
}

// line says whether a line of level whose text is msg is logged, and gives the summary a pattern
// forgotten to make room owed, if any.
func (l *limiter) line(now time.Time, level slog.Level, msg string) (bool, []summary) {
	k := patternKey{level, normalise(msg)}
	p := l.patterns[k]
	var owed []summary
	if p == nil {
		if len(l.patterns) >= maxPatterns {
			owed = l.evict(now)
		}
		p = &pattern{windowStart: now}
		l.patterns[k] = p
	}
	p.lastSeen = now
	if now.Sub(p.windowStart) >= patternWindow {
		p.windowStart, p.lines = now, 0
	}
	p.lines++
	if p.lines <= linesPerWindow {
		return true, owed
	}
	if p.suppressed == 0 {
		p.since = now
	}
	p.suppressed++
	return false, owed
}

// flush gives the summaries owed, and forgets the patterns whose window ended and that owe none.
func (l *limiter) flush(now time.Time) []summary {
	var out []summary
	for k, p := range l.patterns {
		if p.suppressed > 0 {
			out = append(out, summary{k.level, k.text, p.suppressed, now.Sub(p.since)})
			p.suppressed = 0
		} else if now.Sub(p.windowStart) >= patternWindow {
			delete(l.patterns, k)
		}
	}
	return out
}

// evict forgets the pattern seen longest ago, giving its summary when it owes one.
func (l *limiter) evict(now time.Time) []summary {
	var oldest patternKey
	var op *pattern
	for k, p := range l.patterns {
		if op == nil || p.lastSeen.Before(op.lastSeen) {
			oldest, op = k, p
		}
	}
	if op == nil {
		return nil
	}
	delete(l.patterns, oldest)
	if op.suppressed == 0 {
		return nil
	}
	return []summary{{oldest.level, oldest.text, op.suppressed, now.Sub(op.since)}}
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
