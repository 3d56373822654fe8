//! What every request passes before a page: the token, same-origin actions, the CSRF token,
//! the pages' security headers; and the one error page every refusal renders.
use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use distribution::broker;
use maud::Markup;

use super::page::{self, Section};
use super::{Console, Shared};

/// A page that says what went wrong (and never more than the message).
pub(super) struct Failure {
    status: StatusCode,
    message: String,
}

impl Failure {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(super) fn bad(message: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message.to_string())
    }
}

impl Failure {
    fn title(&self) -> &'static str {
        self.status
            .canonical_reason()
            .unwrap_or("Something went wrong")
    }
}

/// A failure's page as rendered by a handler, which cannot see the console: without the
/// navigation. The guard, which can, renders it again with the navigation (the dead-letter
/// pages' links included), except for a request it refused itself (no token: nothing of the
/// console's settings is shown).
impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = page::layout(
            self.title(),
            Section::None,
            &[],
            page::error(self.status.as_u16(), &self.message),
        );
        let mut response = (self.status, body).into_response();
        response.extensions_mut().insert(std::sync::Arc::new(self));
        response
    }
}

impl From<distribution::store::Error> for Failure {
    fn from(err: distribution::store::Error) -> Self {
        use distribution::store::Error;
        match err {
            Error::Database(_) | Error::Migrate(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the database: {err}"),
            ),
            refused => Self::bad(refused),
        }
    }
}

impl From<broker::Error> for Failure {
    fn from(err: broker::Error) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, format!("the broker: {err}"))
    }
}

impl From<FormRejection> for Failure {
    fn from(rejection: FormRejection) -> Self {
        Self::new(rejection.status(), rejection.body_text())
    }
}

impl From<QueryRejection> for Failure {
    fn from(rejection: QueryRejection) -> Self {
        Self::new(rejection.status(), rejection.body_text())
    }
}

pub(super) type Page = Result<Markup, Failure>;

/// Every request: the token (if any), same-origin actions, and the pages' security headers.
pub(super) async fn guard(State(console): Shared, request: Request, next: Next) -> Response {
    let mut response = if !console.authorized(request.headers()) {
        let mut response = Failure::new(
            StatusCode::UNAUTHORIZED,
            "the console needs its token (RELAY_CONSOLE_TOKEN) as the password",
        )
        .into_response();
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"outbox relay console\", charset=\"UTF-8\""),
        );
        response
    } else if request.method() == Method::POST && !same_origin(request.headers()) {
        Failure::new(
            StatusCode::FORBIDDEN,
            "an action must come from the console's own pages",
        )
        .into_response()
    } else {
        let response = next.run(request).await;
        match response
            .extensions()
            .get::<std::sync::Arc<Failure>>()
            .cloned()
        {
            Some(failure) => (
                failure.status,
                console.page(
                    failure.title(),
                    Section::None,
                    page::error(failure.status.as_u16(), &failure.message),
                ),
            )
                .into_response(),
            None => response,
        }
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        // `no-referrer` would make the browser send `Origin: null` with the pages' own forms.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// A POST from a page of this console: a browser's `Sec-Fetch-Site` says so, and an `Origin`
/// names the host the request was sent to. (Non-browser clients send neither: the CSRF token
/// still has to match.)
fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site")
        && !matches!(site.to_str(), Ok("same-origin" | "none"))
    {
        return false;
    }
    match (headers.get(header::ORIGIN), headers.get(header::HOST)) {
        (None, _) => true,
        (Some(origin), Some(host)) => {
            let (Ok(origin), Ok(host)) = (origin.to_str(), host.to_str()) else {
                return false;
            };
            url::Url::parse(origin).is_ok_and(|origin| {
                let port = origin
                    .port()
                    .map(|port| format!(":{port}"))
                    .unwrap_or_default();
                origin
                    .host_str()
                    .is_some_and(|name| format!("{name}{port}") == host)
            })
        }
        (Some(_), None) => false,
    }
}

impl Console {
    /// Whether `given` is this console's CSRF token (in constant time).
    fn csrf_ok(&self, given: &str) -> bool {
        use subtle::ConstantTimeEq;
        given.len() == self.csrf.len() && bool::from(given.as_bytes().ct_eq(self.csrf.as_bytes()))
    }

    pub(super) fn check_csrf(&self, given: &str) -> Result<(), Failure> {
        if self.csrf_ok(given) {
            Ok(())
        } else {
            Err(Failure::new(
                StatusCode::FORBIDDEN,
                "this form is not one of the console's (or the console restarted since it was shown): load the page again",
            ))
        }
    }

    /// Whether the request carries the console's token (always, without one).
    fn authorized(&self, headers: &HeaderMap) -> bool {
        use headers::authorization::{Basic, Bearer};
        use headers::{Authorization, HeaderMapExt};
        use subtle::ConstantTimeEq;
        let Some(token) = &self.token else {
            return true;
        };
        let given = if let Some(basic) = headers.typed_get::<Authorization<Basic>>() {
            basic.password().to_owned()
        } else if let Some(bearer) = headers.typed_get::<Authorization<Bearer>>() {
            bearer.token().to_owned()
        } else {
            return false;
        };
        given.len() == token.len() && bool::from(given.as_bytes().ct_eq(token.as_bytes()))
    }
}

pub(super) async fn not_found() -> Failure {
    Failure::new(StatusCode::NOT_FOUND, "no such page")
}

pub(super) async fn method_not_allowed() -> Failure {
    Failure::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "this page does not take that method",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn an_action_must_come_from_the_consoles_own_pages() {
        let host = ("host", "127.0.0.1:9181");
        // A browser on the console's page; a script or curl sending neither header.
        assert!(same_origin(&headers(&[
            host,
            ("origin", "http://127.0.0.1:9181"),
            ("sec-fetch-site", "same-origin")
        ])));
        assert!(same_origin(&headers(&[host])));
        // Another site, a sibling port, an opaque origin, a cross-site fetch.
        assert!(!same_origin(&headers(&[
            host,
            ("origin", "http://evil.example")
        ])));
        assert!(!same_origin(&headers(&[
            host,
            ("origin", "http://127.0.0.1:9182")
        ])));
        assert!(!same_origin(&headers(&[host, ("origin", "null")])));
        assert!(!same_origin(&headers(&[
            host,
            ("sec-fetch-site", "cross-site")
        ])));
        assert!(!same_origin(&headers(&[
            host,
            ("sec-fetch-site", "same-site")
        ])));
        assert!(!same_origin(&headers(&[(
            "origin",
            "http://127.0.0.1:9181"
        )])));
    }
}
