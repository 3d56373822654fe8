-- A host header may no longer be named `ce-*` (any case): the CloudEvents NATS protocol
-- binding's binary content mode names its attributes so (`ce-id`, `ce-type`, ...), and the
-- relay writes them on NATS with RELAY_CLOUDEVENTS=true (broker/WIRE.md, "On NATS
-- JetStream"). Refused on either broker (RL112), as store::meta refuses it before any SQL, like
-- `cloudevents*` (the AMQP binding's prefix) since 0008. Every other rule is 0018's, unchanged:
-- its function keeps them under another name and this one calls it first. The new function
-- gets the grants the old one had (`distribution roles` revokes PUBLIC's), the old one keeps
-- its own.
ALTER FUNCTION relay_require_meta(jsonb) RENAME TO relay_require_meta_0018;

CREATE FUNCTION relay_require_meta(p_meta jsonb) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_key text;
BEGIN
    PERFORM relay_require_meta_0018(p_meta);
    IF jsonb_typeof(p_meta->'headers') = 'object' THEN
        FOR v_key IN SELECT jsonb_object_keys(p_meta->'headers') LOOP
            IF starts_with(lower(v_key), 'ce-') THEN
                RAISE EXCEPTION 'header % is reserved by the wire contract', v_key
                    USING ERRCODE = 'RL112', DETAIL = format('field=header %s', v_key);
            END IF;
        END LOOP;
    END IF;
END
$$;
COMMENT ON FUNCTION relay_require_meta(jsonb) IS 'Raises RL112 (DETAIL field=<name>) unless p_meta is valid intent metadata (see store/src/meta.rs): the rules of relay_require_meta_0018, and no header named ce-*.';

DO $$
DECLARE
    v_acl aclitem[];
    v_grantee oid;
BEGIN
    SELECT proacl INTO v_acl FROM pg_proc WHERE oid = 'relay_require_meta_0018(jsonb)'::regprocedure;
    IF v_acl IS NULL THEN
        RETURN; -- never granted nor revoked: the default (EXECUTE to PUBLIC) holds for both
    END IF;
    REVOKE EXECUTE ON FUNCTION relay_require_meta(jsonb) FROM PUBLIC;
    FOR v_grantee IN SELECT a.grantee FROM aclexplode(v_acl) a WHERE a.privilege_type = 'EXECUTE' LOOP
        IF v_grantee = 0 THEN
            GRANT EXECUTE ON FUNCTION relay_require_meta(jsonb) TO PUBLIC;
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION relay_require_meta(jsonb) TO %I', pg_get_userbyid(v_grantee));
        END IF;
    END LOOP;
END
$$;
