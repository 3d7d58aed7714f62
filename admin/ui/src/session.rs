//! Who is logged in, shared by every page through Leptos' context.

use leptos::prelude::*;
use sluice_api::people::Role;
use sluice_api::SessionInfo;

use crate::api::ApiError;

#[derive(Clone, Copy)]
pub(crate) struct Session(pub(crate) RwSignal<Option<SessionInfo>>);

impl Session {
    fn role(&self) -> Role {
        self.0
            .with(|s| s.as_ref().map(|s| s.role).unwrap_or_default())
    }

    pub(crate) fn can_edit(&self) -> bool {
        self.role().can_edit()
    }

    pub(crate) fn can_administer(&self) -> bool {
        self.role().can_administer()
    }

    pub(crate) fn csrf(&self) -> String {
        self.0
            .with_untracked(|s| s.as_ref().map(|s| s.csrf_token.clone()).unwrap_or_default())
    }

    /// A 401 anywhere means the session is over: back to the login page.
    pub(crate) fn check(&self, e: &ApiError) {
        if *e == ApiError::Unauthorized {
            self.0.set(None);
        }
    }
}
