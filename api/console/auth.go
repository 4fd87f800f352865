package console

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/sandgate/sandgate/api"
	"github.com/sandgate/sandgate/api/server"
)

// cookieName is the session cookie's. Its value is
// "v1.<expiry unix>.<session id>.<mac>": the mac an HMAC-SHA256 of the
// rest under a key derived from the service token, so the cookie holds
// neither the token nor anything from which it could be found, a new
// token voids every cookie, and the console keeps no session table (only
// the sessions signed out before they expire, so that a copied cookie
// dies with its sign-out).
const cookieName = "sandgate-console"

// maxRevoked bounds the signed-out sessions remembered; past it the
// oldest are forgotten (they still expire).
const maxRevoked = 10000

// session is who a request is: signed in (id), the token in the API's
// header, or nobody needed (a console without a token).
type session struct {
	id     string
	header bool // authenticated by the API's token header: no cookie, no CSRF
	open   bool // the console has no token
}

type sessionKey struct{}

func sessionOf(r *http.Request) session {
	s, _ := r.Context().Value(sessionKey{}).(session)
	return s
}

// publicPath says whether r may be served without auth: the sign-in page,
// its form, and the stylesheet the page uses (no data in any of them).
func publicPath(r *http.Request) bool {
	return r.URL.Path == "/ui/signin" || r.Method == http.MethodGet && r.URL.Path == "/ui/static/console.css"
}

// guard refuses what no auth makes right: a host name other than the
// loopback ones when the service listens there without a token (a DNS
// rebinding), a state change another site asked for, and another site's
// script reading a page.
func (c *Console) guard(r *http.Request) error {
	if c.cfg.LocalOnly {
		if host, ok := server.LocalHost(r.Host, c.cfg.LocalHosts); !ok {
			return errorf(http.StatusForbidden, "host %q is refused: without a token this service answers only for localhost, IP addresses and the names in SANDGATE_LOCAL_HOSTNAMES (a DNS rebinding defence); add %q to SANDGATE_LOCAL_HOSTNAMES, or set SANDBOX_SERVICE_TOKEN", host, host)
		}
	}
	site := r.Header.Get("Sec-Fetch-Site")
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		// The browser says where the request came from (Sec-Fetch-Site,
		// relative to the page, so right behind a proxy that rewrites the
		// Host too); an older one only its Origin, compared to the Host.
		if site != "" && site != "same-origin" {
			return errorf(http.StatusForbidden, "a %s request from another site (%s) is refused: act from the console's own pages", r.Method, site)
		}
		if o := r.Header.Get("Origin"); site == "" && o != "" && o != origin(r) {
			return errorf(http.StatusForbidden, "a %s request from origin %q is refused: act from the console's own pages", r.Method, o)
		}
		return nil
	}
	if (site == "cross-site" || site == "same-site") && r.Header.Get("Sec-Fetch-Mode") != "navigate" {
		return errorf(http.StatusForbidden, "another site's page may link to the console, not read it")
	}
	return nil
}

// origin is r's origin as a browser would write it.
func origin(r *http.Request) string {
	if secure(r) {
		return "https://" + r.Host
	}
	return "http://" + r.Host
}

// secure says whether the browser reached the service over TLS (here, or
// at a front end that says so).
func secure(r *http.Request) bool {
	return r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https")
}

// authenticate says who sent r: the token in the API's header, a valid
// session cookie, or nobody needed; otherwise a 401.
func (c *Console) authenticate(r *http.Request) (session, error) {
	if c.cfg.Token == "" {
		return session{open: true}, nil
	}
	if v := r.Header.Values(api.HeaderToken); len(v) > 0 {
		got := sha256.Sum256([]byte(v[0]))
		if len(v) == 1 && subtle.ConstantTimeCompare(got[:], c.token[:]) == 1 {
			return session{header: true}, nil
		}
		return session{}, errorf(http.StatusUnauthorized, "wrong %s: give the service token once", api.HeaderToken)
	}
	if ck, err := r.Cookie(cookieName); err == nil {
		if id, ok := c.verify(ck.Value); ok {
			return session{id: id}, nil
		}
	}
	if publicPath(r) {
		return session{}, nil
	}
	return session{}, errorf(http.StatusUnauthorized, "sign in at /ui/signin with the service token (SANDBOX_SERVICE_TOKEN), or send it in %s", api.HeaderToken)
}

// mac is the session mac of msg, hex.
func (c *Console) mac(msg string) string {
	m := hmac.New(sha256.New, c.key)
	m.Write([]byte(msg))
	return hex.EncodeToString(m.Sum(nil))
}

// issue makes a new session's cookie value.
func (c *Console) issue() (value, id string, expires time.Time) {
	var b [18]byte
	rand.Read(b[:])
	id = base64.RawURLEncoding.EncodeToString(b[:])
	expires = c.cfg.Now().Add(c.cfg.SessionTTL)
	body := "v1." + strconv.FormatInt(expires.Unix(), 10) + "." + id
	return body + "." + c.mac(body), id, expires
}

// verify checks a cookie value: its mac (constant time), its expiry, and
// that it was not signed out. It returns the session id.
func (c *Console) verify(v string) (string, bool) {
	parts := strings.Split(v, ".")
	if len(parts) != 4 || parts[0] != "v1" {
		return "", false
	}
	body := strings.Join(parts[:3], ".")
	if !hmac.Equal([]byte(c.mac(body)), []byte(parts[3])) {
		return "", false
	}
	exp, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil || !c.cfg.Now().Before(time.Unix(exp, 0)) {
		return "", false
	}
	c.mu.Lock()
	_, gone := c.revoked[parts[2]]
	c.mu.Unlock()
	return parts[2], !gone
}

// revoke remembers a signed-out session until it would have expired.
func (c *Console) revoke(id string, until time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.cfg.Now()
	for k, t := range c.revoked {
		if !now.Before(t) {
			delete(c.revoked, k)
		}
	}
	if len(c.revoked) >= maxRevoked {
		var oldest string
		for k, t := range c.revoked {
			if oldest == "" || t.Before(c.revoked[oldest]) {
				oldest = k
			}
		}
		delete(c.revoked, oldest)
	}
	c.revoked[id] = until
}

// csrf is the CSRF token of a session: what its pages' forms carry.
func (c *Console) csrf(s session) string { return c.mac("csrf." + s.id)[:32] }

// checkCSRF checks a POST's CSRF token (form field csrf, or the
// X-Sandgate-Csrf header of the console's script) in constant time.
func (c *Console) checkCSRF(r *http.Request, s session) error {
	got := r.Header.Get("X-Sandgate-Csrf")
	if got == "" {
		got = r.PostFormValue("csrf")
	}
	if !hmac.Equal([]byte(got), []byte(c.csrf(s))) {
		return errorf(http.StatusForbidden, "the form's CSRF token is missing or stale: reload the page and try again")
	}
	return nil
}

func (c *Console) setCookie(w http.ResponseWriter, r *http.Request, value string, maxAge int) {
	http.SetCookie(w, &http.Cookie{
		Name: cookieName, Value: value, Path: Prefix, MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: secure(r),
	})
}

type signinData struct {
	pageData
	Next  string
	Error string
	TTL   string // how long a sign-in lasts
}

func (c *Console) signinPage(w http.ResponseWriter, r *http.Request) error {
	s := sessionOf(r)
	next := safeNext(r.URL.Query().Get("next"))
	if s.open || s.id != "" || s.header {
		http.Redirect(w, r, next, http.StatusSeeOther)
		return nil
	}
	return c.render(w, r, http.StatusOK, "signin.html", signinData{pageData: c.page(r, "Sign in"), Next: next, TTL: ago(c.cfg.SessionTTL)})
}

func (c *Console) signin(w http.ResponseWriter, r *http.Request) error {
	next := safeNext(r.PostFormValue("next"))
	if c.cfg.Token == "" {
		http.Redirect(w, r, next, http.StatusSeeOther)
		return nil
	}
	got := sha256.Sum256([]byte(r.PostFormValue("token")))
	if subtle.ConstantTimeCompare(got[:], c.token[:]) != 1 {
		c.log.Warn("console: a sign-in with a wrong token", "remote", r.RemoteAddr)
		return c.render(w, r, http.StatusUnauthorized, "signin.html", signinData{pageData: c.page(r, "Sign in"), Next: next, TTL: ago(c.cfg.SessionTTL),
			Error: "That is not the service token. It is the value of SANDBOX_SERVICE_TOKEN the service was started with."})
	}
	value, id, expires := c.issue()
	c.setCookie(w, r, value, int(time.Until(expires).Seconds()))
	c.log.Info("console: signed in", "remote", r.RemoteAddr, "session", id[:6])
	http.Redirect(w, r, next, http.StatusSeeOther)
	return nil
}

func (c *Console) signout(w http.ResponseWriter, r *http.Request) error {
	if s := sessionOf(r); s.id != "" {
		if ck, err := r.Cookie(cookieName); err == nil {
			if parts := strings.Split(ck.Value, "."); len(parts) == 4 {
				exp, _ := strconv.ParseInt(parts[1], 10, 64)
				c.revoke(s.id, time.Unix(exp, 0))
			}
		}
	}
	c.setCookie(w, r, "", -1)
	http.Redirect(w, r, "/ui/signin", http.StatusSeeOther)
	return nil
}

// safeNext is where to go after signing in: a console path (as a browser
// would resolve it), or the list.
func safeNext(next string) string {
	u, err := url.Parse(next)
	if err != nil || next == "" || u.Scheme != "" || u.Host != "" || u.User != nil || strings.HasPrefix(next, "//") || strings.Contains(next, "\\") {
		return Prefix
	}
	p := path.Clean("/" + u.Path)
	if p != Prefix && !strings.HasPrefix(p, Prefix+"/") || strings.HasPrefix(p, "/ui/signin") {
		return Prefix
	}
	u.Path, u.RawPath = p, ""
	return u.RequestURI()
}

func urlQueryEscape(s string) string { return url.QueryEscape(s) }
