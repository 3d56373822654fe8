//! The relay actors (built in the actor-tree issue).
